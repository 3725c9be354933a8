"""The benchmarks: what `deepinfer bench NAME` runs, and what they share.

Each benchmark is a module with its own options and a `main()`
(`deepinfer bench NAME --help`; `deepinfer bench --help` lists them); the names are
kept in `deepinfer/entrypoints/cli/bench.py`. Shared by several: `replay.py` (trace
requests through the real engine in wall-clock time), `step_events.py` (CUDA events
around each launched step), `step_roofline.py` (a step's roofline),
`model_speed_steps.py`, `profile_step.py` (a torch.profiler table of one step),
`vidur_setup.py`, `plot_model_speed.py`. The package sits above everything else
(it may import the core, `sim`, `executors` and `kernels`; nothing imports it but
the `bench` command and the tests). Figures go to `RESULTS.md`; one-off
investigations, run as scripts, are in `investigations/`.
"""
