"""Decode speed with MTP speculation over without, measured and simulated.

    deepinfer bench speculative [--model moonlight-16b-a3b] [--batches 1,8,32,128,256]
        [--acceptance 0.6,0.8,0.9] [--ks 1,2,3,5] [--json OUT.json]

Random weights cannot draft (their MTP layer agrees with nothing), so this uses a
clearly named BENCHMARK-ONLY stand-in, `ForcedAcceptance`: the real MTP drafter runs
(so its cost is paid) and each of its drafts gets a confidence c ~ Beta(4a, 4(1 - a))
(what it reports: a calibrated drafter, for varlen) and counts as the target's own
greedy continuation with probability c, else as corrupted. Verification runs in full
(its cost is paid too), then accepts exactly the drafts before the first corrupted one
and takes the target's greedy token at the row after them, as greedy verification
does when the drafts match. So acceptance per position is about a, given the earlier
drafts passed. (A first version replaced the drafts with the greedy continuation of a
run without speculation; on the H200 in bf16 that continuation was almost never the
speculating engine's own: random weights leave near-tied logits, and a verify step's
rows round differently from a decode step's, so 1% of drafts were accepted.) The
model is the preset in its published shapes plus one MTP layer (Moonlight ships none;
the layer is a DeepSeek-V3 one in the same shapes), `load_format="dummy"`.

For each batch size B (prompts of --prompt-len random tokens, --max-tokens output
tokens each) it reports decode tokens/s (output tokens after each request's first,
over the time of the steps that compute no prompt tokens) without speculation and
with k drafts at acceptance a, the speed-up, and the simulator's predicted speed-up
for the same workload (same k, per-position acceptance a, default cost model). A batch
smaller than --min-sequences runs as several waves, one after another on one engine
(the simulator replays the same waves), so that batch 1 is timed over 16 requests, not
the 30-40 steps of one, whose luck in acceptance moves its speed-up by about 7%.
Each invocation builds one executor per k (Moonlight: about a minute each with graph
capture) and first runs the plain baseline; the whole default sweep outlasts a 10-minute
device call, so split it: `bash benchmarks/run_device.sh spec --ks 1,2 --acceptance
0.6,0.8,0.9`, then `--ks 3,5`, then `--ks varlen`, each with its own `--json`.
`--ks varlen` runs confidence-scheduled drafts (DEEPINFER_ENABLE_MTP_VARLEN) of at
most --varlen-max drafts.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import executors.model_runner as runner_module
import executors.speculative_decoder as speculator_module
from benchmarks.step_events import StepEvents, SyncWatch
from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.model_config import load_model_config, write_config_with_mtp_layer
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from executors.host_copy import to_device, to_device_async
from executors.mtp_drafter import DeviceDraftInput, DeviceDrafts, DraftInput, Drafts, MTPDrafter
from executors.sampler import SamplingState
from executors.spec_decode import (
    DeviceVerify,
    VerifyOutput,
    VerifyRequest,
    prefix_tokens,
    row_grid,
    verify,
    verify_on_device,
)

WAVE_GAP_S = 3600.0  # simulated seconds between waves: each starts on an idle engine


class ForcedAcceptance:
    """BENCHMARK ONLY: the real drafter's drafts, each counted as the target's greedy
    continuation with probability c (its reported confidence, c ~ Beta(4a, 4(1 - a))),
    and a verification that accepts exactly the drafts before the first one that is
    not, after doing all of its real work. Installed on a model runner by `install`."""

    def __init__(self, inner: MTPDrafter, a: float, seed: int = 0) -> None:
        self.inner = inner
        self.a = min(max(a, 1e-3), 1 - 1e-3)
        self.rng = np.random.default_rng(seed)
        self.accepted: dict[str, int] = {}  # req_id -> drafts its next verification accepts
        # The runner's bookkeeping (what each request's drafter pass still owes) is the
        # real drafter's: the same object, so the runner reads and clears it as usual.
        self.pending = inner.pending
        self.step_inputs = inner.step_inputs

    def propose(self, inputs: list[DraftInput], num_drafts: int | None = None) -> Drafts:
        drafts = self.inner.propose(inputs, num_drafts)
        # One numpy draw for the whole step: this stand-in's host work is not the engine's
        # (a Python draw per draft cost ~1 ms a step at batch 256, inside the timed step).
        rids = list(drafts.tokens)
        width = max((len(t) for t in drafts.tokens.values()), default=0)
        if not width:  # no request sampled (prompt chunks only), or no drafts at all
            return drafts
        conf = self.rng.beta(4 * self.a, 4 * (1 - self.a), size=(len(rids), width))
        good = self.rng.random(size=conf.shape) < conf  # [requests, width]
        first_bad = np.where(good.all(axis=1), width, (~good).argmax(axis=1))
        for i, rid in enumerate(rids):
            n = len(drafts.tokens[rid])
            self.accepted[rid] = min(int(first_bad[i]), n)
            drafts.confidences[rid] = conf[i, :n].tolist()
        return drafts

    def propose_on_device(
        self, inputs: list[DeviceDraftInput], *args: Any, **kwargs: Any
    ) -> DeviceDrafts:
        """`propose`'s plan for the drafter of a step on the device (its draws on the
        host; the confidences go to the device, as the real drafter's are)."""
        drafts = self.inner.propose_on_device(inputs, *args, **kwargs)
        width = drafts.ids.shape[1]
        if not width or not inputs:
            return drafts
        conf = self.rng.beta(4 * self.a, 4 * (1 - self.a), size=(len(inputs), width))
        good = self.rng.random(size=conf.shape) < conf  # [inputs, width]
        first_bad = np.where(good.all(axis=1), width, (~good).argmax(axis=1))
        for i, x in enumerate(inputs):
            if drafts.counts[i]:
                self.accepted[x.req_id] = min(int(first_bad[i]), drafts.counts[i])
        host = torch.from_numpy(conf.astype(np.float32))
        drafts.confidences = to_device_async(host, drafts.ids.device)
        return drafts

    def verify_on_device(
        self,
        runner: Any,
        logits: torch.Tensor,
        states: list[SamplingState],
        num_drafts: list[int],
        draft_ids: torch.Tensor,
        generator: torch.Generator | None,
    ) -> DeviceVerify:
        """spec_decode.verify_on_device's work, then the planned acceptance (`verify`'s),
        all on the device."""
        verify_on_device(logits, states, num_drafts, draft_ids, generator)
        rid = {id(st.sampling): r for r, st in runner.requests.items()}
        take = [min(self.accepted.get(rid[id(s)], 0), k) for s, k in zip(states, num_drafts)]
        accepted = to_device(take, torch.int64, logits.device)
        grid = row_grid(num_drafts, logits.device)
        return DeviceVerify(prefix_tokens(logits.argmax(-1), draft_ids, accepted, grid), accepted)

    def verify(
        self,
        runner: Any,
        logits: torch.Tensor,
        reqs: list[VerifyRequest],
        generator: torch.Generator | None,
        batch_invariant: bool = False,
    ) -> VerifyOutput:
        """spec_decode.verify's work, then the planned acceptance: drafts before the
        first corrupted one, and the target's greedy token at the row after them."""
        real = verify(logits, reqs, generator, batch_invariant)
        rid = {id(st.sampling): r for r, st in runner.requests.items()}
        take = [min(self.accepted.get(rid[id(r.state)], 0), len(r.drafts)) for r in reqs]
        rows = torch.tensor([r.first + a for r, a in zip(reqs, take)], device=logits.device)
        bonus = logits[rows].argmax(dim=-1).tolist()  # [requests]
        tokens = [r.drafts[:a] + [t] for r, a, t in zip(reqs, take, bonus)]
        return VerifyOutput(tokens, real.logprobs)

    def install(self, runner: Any) -> None:
        """Make `runner` draft and verify through this stand-in (greedy requests only),
        on the host and on the device; `uninstall` gives verification back."""
        runner.speculator.drafter = self
        runner_module.verify = lambda *a, **k: self.verify(runner, *a, **k)
        speculator_module.verify_on_device = lambda *a, **k: self.verify_on_device(runner, *a, **k)

    @staticmethod
    def uninstall() -> None:
        runner_module.verify = verify
        speculator_module.verify_on_device = verify_on_device


def model_dir(name: str) -> Path:
    """A config directory: the preset (or a config.json path) with one MTP layer, named
    after the model (so the simulator finds the model's profile)."""
    return write_config_with_mtp_layer(name, tempfile.mkdtemp(prefix="spec-bench-"))


def length_mix(steps: Sequence[Any]) -> str:
    """Decode steps (StepRecords, real or simulated) by the drafts each request verified
    (tokens / requests - 1), as "L: steps x median ms": what varlen chose and what each
    length cost. A record holds no per-request counts: a step whose tokens do not divide
    evenly among its requests is counted as ragged, one that does at its mean length."""
    by_len: dict[int, list[float]] = {}
    ragged = 0
    for s in steps:
        if s.num_scheduled_reqs and s.num_batched_tokens % s.num_scheduled_reqs == 0:
            length = s.num_batched_tokens // s.num_scheduled_reqs - 1
            by_len.setdefault(length, []).append(s.duration)
        else:
            ragged += 1
    cells = [
        f"{n}: {len(d)} x {1e3 * statistics.median(d):.1f} ms" for n, d in sorted(by_len.items())
    ]
    return ", ".join(cells + ([f"ragged: {ragged}"] if ragged else []))


def steps_line(steps: Sequence[Any]) -> str:
    """Each decode step (StepRecords) as "id: requests x drafts verified, drafts
    proposed after it, ms", what varlen chose and timed step by step (a ragged step's
    drafts are its mean)."""
    cells = []
    for s in steps:
        n = max(s.num_scheduled_reqs, 1)
        proposed = "" if s.num_proposals is None else f" P{s.num_proposals}"
        drafts = s.num_batched_tokens / n - 1
        cells.append(f"{s.step_id}: {n} x L{drafts:g}{proposed} {1e3 * s.duration:.2f}ms")
    return " | ".join(cells)


def run(
    executor: Any,
    cfg: EngineConfig,
    prompts: list[list[int]],
    max_tokens: int,
    tag: str,
    profile_steps: int = 0,
    waves: int = 1,
    sync_debug: bool = False,
    step_log: bool = False,
) -> tuple[float, dict[str, list[int]], float | None, str]:
    """Decode tokens/s of `waves` batches of `prompts`, one after another on one engine
    (as a served engine keeps what varlen learned of its step times), each request's
    output, the draft acceptance, and a line on their decode steps (mean ms, tokens
    scored per request, how many chained on the verify step in flight:
    executors/spec_chain.py). profile_steps: print where that many decode steps (after 4
    warm ones) of the first wave spend their time (profile_step.py's kernel table and
    GPU idle time by host region; the run's figures then include the profiler's
    overhead). sync_debug: also count the calls that made the host wait for the device,
    by line (step_events.SyncWatch; they slow the run a little). step_log: also list
    the speculating run's decode steps one by one (`steps_line`)."""
    engine = EngineCore(cfg, executor, model_max_len=executor.max_model_len)
    chained_before = executor.runner.num_chained_steps
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reqs: list[Request] = []
    on_cuda = getattr(executor, "device", torch.device("cpu")).type == "cuda"
    events = StepEvents(executor) if on_cuda else contextlib.nullcontext()
    watch = SyncWatch() if sync_debug and on_cuda else contextlib.nullcontext()
    with events, watch:
        _run_waves(engine, executor, prompts, params, tag, profile_steps, waves, reqs)
    decode = [s for s in engine.steps if s.num_prompt_tokens == 0]
    seconds = sum(s.duration for s in decode)
    tokens = sum(len(r.output_token_ids) - 1 for r in reqs)
    s = engine.scheduler
    acc = s.num_accepted_drafts / s.num_draft_tokens if s.num_draft_tokens else None
    outs = {r.request_id: r.output_token_ids for r in reqs}
    steps = max(len(decode), 1)
    per_req = sum(s.num_batched_tokens / max(s.num_scheduled_reqs, 1) for s in decode) / steps
    chained = executor.runner.num_chained_steps - chained_before
    line = (
        f"{len(decode)} decode steps, {1e3 * seconds / steps:.2f} ms each, "
        f"{per_req:.2f} tokens a request, {chained} chained"
        + (f", {waves} waves" if waves > 1 else "")
    )
    if cfg.enable_mtp_varlen:
        line += "; drafts verified: " + length_mix(decode)
    if step_log:
        line += "; steps: " + steps_line(decode)
    if isinstance(events, StepEvents) and not profile_steps:
        line += "; " + events.line([s.step_id for s in decode])
    if isinstance(watch, SyncWatch):
        line += "; " + watch.line(len(engine.steps))
    return tokens / seconds if seconds else 0.0, outs, acc, line


def _run_waves(
    engine: EngineCore,
    executor: Any,
    prompts: list[list[int]],
    params: SamplingParams,
    tag: str,
    profile_steps: int,
    waves: int,
    reqs: list[Request],
) -> None:
    """`run`'s waves, one after another on `engine`; the requests are added to `reqs`."""
    for w in range(waves):
        wave = [Request(f"{tag}-{w}.{i}", list(p), params) for i, p in enumerate(prompts)]
        reqs += wave
        for r in wave:
            engine.add_request(r)
        if profile_steps and w == 0:
            while (
                engine.has_unfinished() and sum(s.num_prompt_tokens == 0 for s in engine.steps) < 4
            ):
                engine.step()
            _profile(engine, executor, profile_steps, tag)
        while engine.has_unfinished():
            engine.step()


def _profile(engine: EngineCore, executor: Any, steps: int, tag: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.profile_step import _mark_regions, _print_idle

    runner = executor.runner
    extra = []
    if (speculator := runner.speculator) is not None:
        extra = [
            (speculator, "verify_and_draft_on_device"),
            (speculator, "_draft_inputs"),
            (speculator.drafter, "propose_on_device"),
        ]
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with _mark_regions(engine, executor, tuple(extra)), profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    print(f"== {tag}: {steps} profiled steps, wall {wall * 1e3:.2f} ms/step", flush=True)
    _print_idle(prof, steps)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20)
    print(table, flush=True)


def simulated_rates(
    cfg_dir: Path,
    cfg: EngineConfig,
    batch: int,
    prompt_len: int,
    max_tokens: int,
    a: float,
    waves: int = 1,
) -> tuple[float, float, str] | None:
    """The simulator's decode tokens/s without and with speculation for the same workload
    (None without simpy), and its speculating decode steps' `length_mix`: `waves`
    batches, each arriving long after the one before has finished. Both sides, beside
    the measured ones, say which the predicted speed-up misses: the plain decode steps'
    price or the verify steps' (and under varlen, whether the lengths chosen differ)."""
    try:
        from sim import simulate
        from sim.traces import TraceRequest
    except ImportError:
        return None
    spec = load_model_config(cfg_dir)
    reqs = wave_requests(TraceRequest, batch, prompt_len, max_tokens, waves)
    rates = []
    for k in (0, cfg.num_speculative_tokens):
        res = simulate(
            reqs, spec, "h200",
            cfg.replace(
                num_speculative_tokens=k, enable_mtp_varlen=cfg.enable_mtp_varlen and k > 0,
                num_gpu_blocks=None,
            ),
            acceptance_rate=a,
        )  # fmt: skip
        decode = [s for s in res.steps if s.num_prompt_tokens == 0]
        rates.append(len(reqs) * (max_tokens - 1) / sum(s.duration for s in decode))
    return rates[0], rates[1], length_mix(decode)


def wave_requests(make: Any, batch: int, prompt_len: int, max_tokens: int, waves: int) -> list[Any]:
    """`waves` batches of trace requests (`make`: sim.traces.TraceRequest), each arriving
    WAVE_GAP_S after the one before."""
    return [
        make(f"r{w}.{i}", w * WAVE_GAP_S, prompt_len, max_tokens)
        for w in range(waves)
        for i in range(batch)
    ]


def num_waves(batch: int, min_sequences: int) -> int:
    """Batches run one after another so that at least `min_sequences` requests are timed:
    at batch 1 one run of 128 tokens is 30-40 verify steps, and the tokens each accepts
    vary enough (about 7% over such a run at a = 0.85) to hide a 5% difference."""
    return max(1, -(-min_sequences // batch))


def main() -> None:
    from executors.torch_executor import TorchExecutor

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="moonlight-16b-a3b", help="preset or config.json")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", default="1,8,32,128,256")
    p.add_argument("--acceptance", default="0.6,0.8,0.9")
    p.add_argument("--ks", default="1,2,3,5,varlen", help="draft counts, or varlen")
    p.add_argument("--varlen-max", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--min-sequences", type=int, default=16,
        help="run a small batch as many times, one wave after another on one engine, as "
        "it takes to time this many requests (batch 1: 16 waves)",
    )  # fmt: skip
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--profile-steps", type=int, default=0,
        help="profile this many decode steps of each speculating run at the first batch",
    )  # fmt: skip
    p.add_argument(
        "--sync-debug", action="store_true",
        help="count the synchronising CUDA calls of every run, by line (the host waiting "
        "for the device leaves it idle under async scheduling)",
    )  # fmt: skip
    p.add_argument(
        "--step-log", action="store_true",
        help="list each speculating run's decode steps: requests, drafts verified and "
        "proposed, ms (what varlen chose and timed)",
    )  # fmt: skip
    args = p.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    accs = [float(x) for x in args.acceptance.split(",")]
    ks = [x for x in args.ks.split(",")]
    cfg_dir = model_dir(args.model)
    vocab = json.loads((cfg_dir / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    max_b = max(batches)
    all_prompts = torch.randint(2, vocab, (max_b, args.prompt_len), generator=gen).tolist()
    base = EngineConfig(
        max_num_seqs=max_b, max_num_batched_tokens=max(8192, args.prompt_len * 8),
        max_model_len=args.prompt_len + args.max_tokens + 16, block_size=64,
    )  # fmt: skip
    rows: list[dict[str, Any]] = []

    def executor(k: str) -> Any:
        varlen = k == "varlen"
        cfg = base.replace(
            num_speculative_tokens=args.varlen_max if varlen else int(k), enable_mtp_varlen=varlen
        )
        return TorchExecutor(
            cfg, str(cfg_dir), dtype=args.dtype, device=args.device, load_format="dummy"
        )

    plain = executor("0")
    ref: dict[int, float] = {}
    for b in batches:
        prof = args.profile_steps if b == batches[0] else 0
        ref[b], _, _, line = run(
            plain, plain.engine_config, all_prompts[:b], args.max_tokens, f"p{b}", prof,
            num_waves(b, args.min_sequences), args.sync_debug,
        )  # fmt: skip
        print(f"batch {b}: {ref[b]:.0f} decode tok/s without speculation ({line})", flush=True)
    plain.shutdown()
    del plain
    gc.collect()
    for k in ks:
        ex = executor(k)
        assert ex.runner.speculator is not None
        inner = ex.runner.speculator.drafter
        for a in accs:
            forced = ForcedAcceptance(inner, a)
            forced.install(ex.runner)
            for b in batches:
                tag = f"k{k}a{a}b{b}"
                prof = args.profile_steps if b == batches[0] else 0
                waves = num_waves(b, args.min_sequences)
                rate, _, acc, line = run(
                    ex, ex.engine_config, all_prompts[:b], args.max_tokens, tag, prof, waves,
                    args.sync_debug, args.step_log,
                )  # fmt: skip
                sim = simulated_rates(
                    cfg_dir, ex.engine_config, b, args.prompt_len, args.max_tokens, a, waves
                )
                sched_speedup = sim and sim[1] / sim[0]
                row = dict(batch=b, k=k, acceptance=a, plain_tok_s=ref[b], spec_tok_s=rate,
                           speedup=rate / ref[b], predicted_speedup=sched_speedup,
                           predicted_plain_tok_s=sim and sim[0],
                           predicted_spec_tok_s=sim and sim[1],
                           measured_acceptance=acc, waves=waves)  # fmt: skip
                rows.append(row)
                pred = (
                    f"{sched_speedup:.2f}x: plain {sim[0]:.0f}, speculating {sim[1]:.0f} tok/s"
                    + (f", drafts verified: {sim[2]}" if ex.engine_config.enable_mtp_varlen else "")
                    if sim and sched_speedup
                    else "n/a"
                )
                print(
                    f"k={k} a={a} batch {b}: {rate:.0f} tok/s, {row['speedup']:.2f}x, "
                    f"drafts accepted {acc or 0:.2f} "
                    f"(simulator {pred}; {line})",
                    flush=True,
                )
        ex.shutdown()
        ForcedAcceptance.uninstall()
        del ex, inner, forced  # the drafters hold the model: free it before the next
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
