"""The training tool of the demo model that ships in `executors/demo/deepinfer-demo/`.

Rebuild the checkpoint from the repository root (the run stops within `--minutes`; the
checkpoint's README.md records the run that made it):

    python -m examples.train_demo.train --out executors/demo/deepinfer-demo --device cuda

`train.py` is the entry point; `corpus.py` (Python stdlib source, held-out split,
BPE), `modeling.py` (transformers' DeepseekV3ForCausalLM plus the MTP module),
`evaluate.py`, `checkpoint.py` (DeepSeek's checkpoint layout) and `readme.py` (the
checkpoint's README.md) are its parts. This tool lives outside the engine's import
path: nothing in deepinfer/, sim/, executors/ or kernels/ imports it, and it is not
installed. It needs the `torch` extra and transformers (the `dev` extra).
"""

COMMAND = "python -m examples.train_demo.train"
