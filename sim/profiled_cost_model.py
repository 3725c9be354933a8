"""The profiled cost model: the analytic model's physics, calibrated on measured steps.

A profile (`deepinfer profile`, shipped under sim/data/profiles/) holds whole engine
steps of the real executor. A step is predicted as a non-negative combination of
features that follow its physics:

  graph, piecewise,     fixed costs of a step replayed as a CUDA graph (pure decode), of
  eager, mixed          any other step (a prompt chunk or a multi-token query: piecewise
                        graphs), the extra of one run eagerly (past the top token
                        bucket, the engine's budget: never cheaper than in graphs, even where
                        the profile measured no eager step), and of a non-decode step
                        that also carries decodes (the absorbed attention path's launches)
  reqs, prompt_reqs     per-request host work (inputs, block tables, sampler state)
  tokens                per-token work the groups below do not price
  decode_max_context    the keys of the longest decode context's piece: split-KV decode
                        attention cuts each context into as many pieces as fill one wave
                        of programs for the step's decode rows (`decode_splits`), and is
                        bound by its longest request's piece when few requests cannot
                        fill the GPU (a host CPU: the whole context, no pieces)
  prefill_wave          prefill attention's critical path in keys: a program a (query
                        tile, request, head) reads its chunk's cached prefix and the rows
                        up to its own, so while the programs fit one wave of SMs the step
                        waits for the longest chunk's keys (a short chunk after a long
                        prefix pays for the whole prefix), beyond it for the programs'
                        keys shared by the SMs (0 on a host CPU: no waves)
  dense ... lm_head     the analytic model's seconds per op group (max of FLOPs over the
                        matmul rate and bytes over the bandwidth: weights, experts touched,
                        prefill and decode attention, logits)

fitted by non-negative least squares on relative error (scipy), so a prediction can only
grow with tokens, context and requests, and extrapolates by the same physics.

Pure-decode steps (CUDA graphs) have regime changes no simple feature captures (the
experts touched saturate, split-KV changes with the batch), and the profile measures
them on a regular batch x context grid. So they are predicted from that grid, made
monotone in both directions and interpolated in log space over the batch and the mean
context; outside the grid, the fit's physics scales the nearest grid value. The fit
and this surface use the profile's plain points (no drafter after the step).

The grid's batches are uniform: every request at one context. A GPU's decode batch
that fits one wave of split-KV attention (ONE_WAVE_BATCH) cuts each context into the
same number of pieces (`decode_splits` of the graph's padded rows), all running at
once: its uniform part costs what a uniform batch at the mean context costs, and the
longest request's pieces then run on alone for their keys past the mean, at the rate of
a piece with the GPU to itself (the batch-1 row's time a key, times its pieces). So a
batch of one 87k-token request beside short ones is priced near what the long request's
pieces take, not as if every request held 87k tokens. A batch the graph pads (its
padding rows alike: one token, no context) reads the surface at its requests and one row
more (`one_wave_decode`), the engine's capture sizes told by its max_num_seqs.

A speculating engine (num_speculative_tokens K > 0) runs the MTP drafter after every
step and verifies drafts: its steps are priced from the profile's speculative points
(sim/profiled_speculation.py: per-k verify surfaces and a fit of the drafter's time),
or, for a profile without them, by physics with a warning that names the profile.

The core's host time around a step (schedule, output processing) is fitted from the
profile's host samples as a + b * requests + c * tokens.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain, repeat
from operator import mul, truediv
from pathlib import Path
from typing import Any

import numpy as np

from deepinfer.decode_run import Batch, DecodeRun
from deepinfer.model_config import ModelConfig
from deepinfer.outputs import SchedulerOutput
from sim.analytic_cost_model import AnalyticCostModel, decode_sums
from sim.cost_coefficients import load_cost_coefficients
from sim.cost_model import CostModel, EngineSettings, RunCosts
from sim.hardware import HardwareSpec
from sim.profile_fit import (
    ONE_WAVE_BATCH,
    PIECEWISE_LIMIT,
    PREFILL_QUERY_TILE,
    StepSurface,
    decode_splits,
    graph_batch,
    nnls_relative,
    one_wave_decode,
    shape_output,
    step_seconds,
    token_bucket,
)
from sim.profiled_speculation import SpeculativeSteps, fallback_target

PROFILES_DIR = Path(__file__).parent / "data" / "profiles"
FEATURES = ("graph", "piecewise", "eager", "mixed", "reqs", "prompt_reqs", "tokens",
            "decode_max_context", "prefill_wave", "dense", "experts", "attn_pre", "attn_dec",
            "lm_head")  # fmt: skip
_GROUPS = FEATURES[9:]
_DECODE_MAX_CONTEXT = FEATURES.index("decode_max_context")
_ATTN_DEC = FEATURES.index("attn_dec")
_EXTRAPOLATION_MARGIN = 1.1


def profile_path(model: str, hardware: str, batch_invariant: bool = False) -> Path:
    """Where the shipped profile of (model, hardware) lives; batch-invariant mode's kernels
    are slower, so a profile measured in it is a file of its own."""
    mode = "__batch_invariant" if batch_invariant else ""
    return PROFILES_DIR / f"{model}__{hardware}{mode}.json"


def find_profile(model: str, hardware: str, batch_invariant: bool = False) -> Path | None:
    """The shipped profile for (model, hardware) in that mode, if one exists."""
    path = profile_path(model, hardware, batch_invariant)
    return path if path.is_file() else None


def load_profile(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the profile ({e})") from None
    for key in ("points", "host", "meta"):
        if key not in data:
            raise ValueError(f"{path}: not a deepinfer profile (no {key!r})")
    if not data["points"]:
        raise ValueError(f"{path}: the profile holds no measured steps")
    data["_path"] = str(path)
    return data


class _Step:
    """One step as both fits of a model read it (`ProfiledCostModel._measure`): its
    batch, effective context (and its mean context), whether it runs eagerly, the drafts the drafter proposes
    after it, what the features read of its requests (`ProfiledCostModel._head`:
    tokens, prompts, the longest decode context or -1 without a decode), and its
    features once the physics needed them."""

    __slots__ = ("out", "n", "effective", "mean", "eager", "num_drafts", "head", "features")

    def __init__(
        self,
        out: SchedulerOutput,
        n: float,
        effective: float,
        mean: float,
        eager: bool,
        num_drafts: int,
        head: tuple[int, int, int, float, int],
    ) -> None:
        self.out = out
        self.n = n
        self.effective = effective
        self.mean = mean
        self.eager = eager
        self.num_drafts = num_drafts
        self.head = head
        self.features: list[float] | None = None


@dataclass(frozen=True)
class FitReport:
    """How well the fit reproduces its own points (signed relative errors)."""

    median_abs_err: float
    p90_abs_err: float
    max_abs_err: float


class ProfiledCostModel(CostModel):
    """step_time and cpu_time from a profile; see the module docstring."""

    def __init__(
        self,
        profile: dict[str, Any] | str | Path,
        model: ModelConfig,
        hardware: HardwareSpec,
        num_speculative_tokens: int = 0,
        *,
        async_scheduling: bool = False,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
    ) -> None:
        """num_speculative_tokens: the drafts the simulated engine's MTP drafter proposes
        after every step (0: it does not speculate; a step that verifies drafts then
        stands for a drafter proposing as many as it verifies). async_scheduling: steps
        are launched while the one before runs, so the runner's host work hides behind
        the device's: steps are priced from the profile's pipelined times (`pipelined_s`,
        each point's steps launched back to back), where it has them for every point the
        engine overlaps (when it speculates, the verify points too: its verify steps
        chain on the step in flight), unless the device is the host
        (`HardwareSpec.runs_on_host`). max_num_seqs, max_num_batched_tokens: the
        simulated engine's limits, which choose the graphs its runner captures (decode
        graphs up to max_num_seqs rows, piecewise token buckets up to the token budget):
        a decode step is priced in the graph that holds it (`one_wave_decode`), a prompt
        chunk at its bucket; the fit reads the profile's points with their own runner's
        limits and graphs (its meta)."""
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens}: must be >= 0")
        data = profile if isinstance(profile, dict) else load_profile(profile)
        self.profile_name = Path(data.get("_path", "profile")).name
        self.meta = data["meta"]
        self.num_speculative_tokens = num_speculative_tokens
        # A profile without this key ran every non-decode step eagerly (0: no piecewise).
        # The fit reads the points as their runner ran them (its piecewise top, capture
        # sizes, graphs or none); the engine's own replace them after it.
        self._piecewise_max = int(self.meta.get("piecewise_max_tokens", 0))
        graphs = bool(self.meta.get("cuda_graphs", True))
        measured_seqs = int(self.meta.get("engine", {}).get("max_num_seqs") or 256)
        self._max_num_seqs = measured_seqs if graphs else 0  # (0: no decode graphs)
        self._analytic = AnalyticCostModel(model, hardware, load_cost_coefficients())
        points = data["points"]
        outs = [shape_output(p["groups"]) for p in points]
        # The plain fit: steps without the drafter (a non-speculating engine's).
        plain = [i for i, p in enumerate(points) if not p.get("drafter")]
        # A speculating runner overlaps its steps too (spec_chain.py): the verify points
        # need their pipelined times (prompt chunks are priced by the plain fit).
        chained = [
            i for i, p in enumerate(points)
            if p.get("drafter") and not any(g[3] for g in p["groups"])
        ]  # fmt: skip
        timed = plain + (chained if num_speculative_tokens else [])
        self.prices_pipelining = all("pipelined_s" in points[i] for i in timed)
        # On a CPU the launch runs the step itself: nothing overlaps, as without async.
        overlaps = async_scheduling and not hardware.runs_on_host
        # A decode batch that fits one wave of a GPU's split-KV attention waits for its
        # longest request (StepSurface); the CPU's attention runs requests of similar
        # length together (kernels/reference.py): its batch costs its contexts' sum.
        self._one_wave = 0 if hardware.runs_on_host else ONE_WAVE_BATCH
        # A GPU's decodes verifying beside prompt chunks take the decode kernel's verify
        # launch (`_verify_attention_beside_chunks`); the CPU's reference attention has no
        # such launch, and the plain fit prices them.
        self._verify_launch = not hardware.runs_on_host
        # Prefill attention (`prefill_wave`) runs a program per (query tile, request,
        # head), one an SM at a time; past one wave the programs' keys (heads x pairs /
        # tile) shared by the SMs set its time: this share of `chunk_pairs` (twice the
        # pairs). The CPU's reference attention has no waves: the pairs (attn_pre) alone.
        sms = 0 if hardware.runs_on_host else hardware.num_sms
        self._wave_share = (
            model.num_attention_heads / (2 * PREFILL_QUERY_TILE * sms) if sms else 0.0
        )
        self._heads, self._sms = model.num_attention_heads, sms  # (the features need them)
        pipelined = overlaps and self.prices_pipelining
        self.pipelined = pipelined  # async steps priced from their pipelined times
        # A step launched on an idle device costs its sequential time (`idle_launch_time`):
        # the same fit on the points' medians, made when first needed.
        self._sequential: ProfiledCostModel | None = None
        self._sequential_args = (data, model, hardware, num_speculative_tokens)
        self._limits_args = {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
        }
        self._settings = EngineSettings(
            num_speculative_tokens, async_scheduling, max_num_seqs, max_num_batched_tokens
        )
        if overlaps and not pipelined:
            warnings.warn(
                f"async_scheduling: profile {self.profile_name} has no pipelined step times "
                "for the steps this engine overlaps (measured before `deepinfer profile` "
                "timed them, or, when speculating, before verify steps chained on the step "
                "in flight): steps are priced as if "
                "each waited for the host's work on the one before, so the simulated engine "
                "is slower than the real one; profile the model again",
                stacklevel=2,
            )
        # The host's seconds inside a launch, where every point the engine overlaps has
        # them (`launch_s`; not when speculating: its verify steps chain on the step in
        # flight): a pipelined step is then priced at the device's own time (`device_s`),
        # the rest of its sequential time its idle-launch part, and its launch apart on
        # the host (`launch_seconds`). Without them a launch is instant and the pipelined
        # time holds it.
        self._launch_coef: list[float] | None = None
        launches = [points[i].get("launch_s") for i in plain]
        if pipelined and not num_speculative_tokens and None not in launches:
            lx = np.array([self._launch_features(outs[i]) for i in plain], dtype=float)
            ly = np.array(launches, dtype=float)
            self._launch_coef = [float(c) for c in nnls_relative(lx, ly)]
        # What each point is priced as: its pipelined time where this engine overlaps it
        # (the plain points, and the chained verify points when it speculates), or the
        # device's own time with the launch apart.
        overlapped = set(timed) if pipelined else set()
        device = self._launch_coef is not None
        y = np.array(
            [step_seconds(p, i in overlapped, device) for i, p in enumerate(points)], dtype=float
        )
        x = np.array([self.features(outs[i]) for i in plain])
        self.coef = nnls_relative(x, y[plain])
        self._coef = [float(c) for c in self.coef]  # plain floats: the per-step path
        graph = [i for i in plain if not self._eager(outs[i])]
        self._decode = StepSurface(
            [outs[i] for i in graph], y[graph], self._physics, uniform=self._uniform_decode_physics
        )
        # A log-fitted profile carries the rate its fit took the tails off at.
        rate = self.meta.get("decode_piece_key_s")
        self._piece_key_s = self._solo_piece_key_seconds() if rate is None else float(rate)
        # Without CUDA graphs (a CPU profile) every k runs the same eager path.
        graphed = self.meta.get("hardware") != "cpu"
        # (the verify points hold pipelined times where a speculating engine needs them)
        self._spec = SpeculativeSteps(
            points, outs, self._analytic, self._physics, graphed,
            pipelined and bool(num_speculative_tokens),
            num_heads=model.num_attention_heads, num_sms=sms,
        )  # fmt: skip
        self._limits = {"tokens": 1 << 62, "reqs": 1 << 62, "context": 1 << 62}
        self._warned: set[str] = set()
        with warnings.catch_warnings():  # its own points: nothing to warn about
            warnings.simplefilter("ignore")
            pred = np.array(
                [self.price_point(o, int(p.get("drafter", 0))) for p, o in zip(points, outs)]
            )
        err = np.abs(pred - y) / y
        self.fit = FitReport(float(np.median(err)), float(np.quantile(err, 0.9)), float(err.max()))
        self.point_errors = ((pred - y) / y).tolist()
        host = data["host"]
        hx = np.array([[1.0, h["num_reqs"], h["num_tokens"]] for h in host], dtype=float)
        hy = np.array([h["schedule_s"] + h["process_s"] for h in host], dtype=float)
        self.host_coef = nnls_relative(hx, hy) if len(host) else np.zeros(3)
        self._host = tuple(float(c) for c in self.host_coef)
        self._limits = {
            "tokens": max(o.num_batched_tokens for o in outs),
            "reqs": max(len(o.scheduled) for o in outs),
            "context": max(r.num_computed_tokens + r.num_tokens for o in outs
                           for r in o.scheduled),
        }  # fmt: skip
        self._warned = set()
        if self._piecewise_max:  # the buckets this engine's runner captures
            self._piecewise_max = min(max_num_batched_tokens, PIECEWISE_LIMIT)
        if graphs:  # and its decode graphs
            self._max_num_seqs = max_num_seqs
            self._decode.forget_physics()  # (kept while fitting, under the profile's graphs)
        if num_speculative_tokens and not self._spec.ready:
            self._warn_no_verify_points(num_speculative_tokens, stacklevel=3)

    def for_engine(
        self, model: ModelConfig, hardware: HardwareSpec, settings: EngineSettings
    ) -> ProfiledCostModel:
        """This model where it was built for an engine of these settings, else its
        profile fitted again for them (as its own class): a model built for other drafts,
        scheduling or limits would price another engine's steps (other verify steps,
        sequential times for pipelined ones, other graphs and token buckets). Built for
        another model or hardware, it is refused: its profile measured other steps."""
        data, own_model, own_hardware, _ = self._sequential_args
        if own_model.name != model.name or own_hardware != hardware:
            raise ValueError(
                f"cost model fitted on profile {self.profile_name} for {own_model.name} on "
                f"{own_hardware.name} cannot price {model.name} on {hardware.name}: build it "
                "for the simulated model and hardware, or pass cost_model='profiled'"
            )
        if settings == self._settings:
            return self
        return type(self)(
            data, own_model, own_hardware, settings.num_speculative_tokens,
            async_scheduling=settings.async_scheduling, max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
        )  # fmt: skip

    @property
    def prices_speculation(self) -> bool:
        """The profile holds verify points (and the drafter's times) to price a
        speculating engine's steps from."""
        return self._spec.ready

    # --- the CostModel contract -------------------------------------------------

    def step_time(self, out: SchedulerOutput) -> float:
        step = self._measure(out, self._drafts_proposed(out))
        return 0.0 if step is None else self._price(step)

    def launch_cost(self, out: SchedulerOutput) -> tuple[float, float]:
        """(`step_time(out)`, the seconds more it costs when launched on an idle device):
        a pipelined step's input preparation and read-back hide behind the step before
        it; with nothing running (the first step after the engine idled, or one launched
        after the step before was applied) they are on the device's path, and the step
        takes its sequential time, the points' medians. Both fits price the one pass
        over the step's requests (and its features), so a launch is measured once."""
        step = self._measure(out, self._drafts_proposed(out))
        if step is None:
            return 0.0, 0.0
        priced = self._price(step)
        if not self.pipelined:
            return priced, 0.0
        extra = self._sequential_model()._price(step) - priced
        return priced, extra if extra > 0.0 else 0.0

    @property
    def prices_launches(self) -> bool:
        """The launch is priced apart (`launch_seconds`): async scheduling, not speculating,
        and every plain point with its launch timed."""
        return self._launch_coef is not None

    def launch_seconds(self, out: SchedulerOutput) -> float:
        """The launch fit's price of `out` (CostModel.launch_seconds); 0.0 without one."""
        if self._launch_coef is None or not out.scheduled:
            return 0.0
        return self._launch_price(self._launch_features(out))

    def _launch_features(self, out: SchedulerOutput) -> list[float]:
        """What the host's launch of a step does, as the runner chooses its forward: a
        decode graph's replay (pure decode up to the graphs' rows), a piecewise step (its
        pieces' replays, then layer by layer the eager attention: the decode half where
        it has decodes, the prefill half where it has prompt chunks) or an eager one; and
        per request and per token (its inputs and metadata)."""
        decodes = chunks = tokens = 0
        for r in out.scheduled:
            q = r.num_tokens
            tokens += q
            if q > 1 and r.is_prompt:
                chunks += 1
            else:
                decodes += 1
        return self._launch_head(len(out.scheduled), tokens, decodes, chunks)

    def _launch_head(self, n: int, tokens: int, decodes: int, chunks: int) -> list[float]:
        graph = tokens == n and 0 < n <= self._max_num_seqs
        piecewise = not graph and tokens <= self._piecewise_max
        return [
            float(graph), float(piecewise), float(not graph and not piecewise),
            float(decodes > 0 and not graph), float(chunks > 0), float(n), float(tokens),
        ]  # fmt: skip

    def _decode_launch(self, n: int) -> float:
        """`launch_seconds` of a pure-decode step of n requests (a decode run's)."""
        if self._launch_coef is None:
            return 0.0
        return self._launch_price(self._launch_head(n, n, n, 0))

    def _launch_price(self, features: list[float]) -> float:
        assert self._launch_coef is not None
        return sum(map(mul, features, self._launch_coef))

    def _sequential_model(self) -> ProfiledCostModel:
        """The fit on the points' medians, which prices a launch on an idle device."""
        if self._sequential is None:
            with warnings.catch_warnings():  # (the pipelined fit warned already)
                warnings.simplefilter("ignore")
                self._sequential = ProfiledCostModel(*self._sequential_args, **self._limits_args)
            self._sequential._warned = self._warned  # one warning a range, not two
        return self._sequential

    def decode_run_costs(self, run: DecodeRun) -> RunCosts | None:
        """A decode run's steps from the decode surface (exactly `cpu_time` and
        `launch_cost` of each step's output: the same batch and effective context read
        off the run's context sums); None when speculating or without a surface."""
        if self.num_speculative_tokens or not self._decode.ready:
            return None
        sequential = None
        if self.pipelined:
            sequential = self._sequential_model()
            if not sequential._decode.ready:
                return None
        return self._decode_run(run, sequential)

    def _decode_run(self, run: DecodeRun, sequential: ProfiledCostModel | None) -> RunCosts:
        """Each of the run's batches priced by `_decode_batch`, one after another."""
        batches = run.batches()
        first = self._decode_batch(next(batches), sequential)
        if min(run.limits) >= run.horizon:  # (one batch)
            return first
        return chain(first, chain.from_iterable(self._decode_batch(b, sequential) for b in batches))

    def _decode_batch(self, batch: Batch, sequential: ProfiledCostModel | None) -> RunCosts:
        """`_measure` then `_price` (and the sequential model's) of each step, by hand:
        step s's contexts' mean is (ctx_sum + n * s) / n, its longest ctx_max + s, each
        at least 1.0; one wave prices the mean and the longest's pieces past it
        (`_plain_decode`)."""
        n, ctx_max, ctx_sum, horizon = (
            batch.num_reqs, batch.ctx_max, batch.ctx_sum, batch.num_steps
        )  # fmt: skip
        a, b, c = self._host
        cpu = a + b * n + c * n
        launch = self._decode_launch(n)
        one_wave = n <= self._one_wave
        lim, m = self._limits, _EXTRAPOLATION_MARGIN
        beyond = n > lim["tokens"] * m or n > lim["reqs"] * m
        longest_limit = lim["context"] * m
        if one_wave:
            costs = self._one_wave_run(n, ctx_max, ctx_sum, horizon, cpu, sequential, launch)
        else:
            beside = None if sequential is None else sequential._decode
            means = _means(n, ctx_sum, horizon)
            costs = self._decode.run_costs(float(n), means, cpu, beside, launch=launch)
        if beyond or ctx_max + horizon > longest_limit:  # a step may warn: each checks
            return self._warning_range(costs, n, ctx_max, beyond, longest_limit)
        return costs

    def _one_wave_run(
        self,
        n: int,
        ctx_max: int,
        ctx_sum: int,
        horizon: int,
        cpu: float,
        sequential: ProfiledCostModel | None,
        launch: float,
    ) -> RunCosts:
        """A one-wave batch's steps: the surface at each step's mean plus the longest
        request's pieces past it (`_plain_decode`), both models in one pass
        (`StepSurface.run_costs` with their tails)."""
        batch, splits = one_wave_decode(n, self._max_num_seqs, self._heads, self._sms)
        beside = None if sequential is None else sequential._decode
        seq_key_s = 0.0 if sequential is None else sequential._piece_key_s
        tail = (ctx_max, self._piece_key_s, seq_key_s, splits)
        means = _means(n, ctx_sum, horizon)
        return self._decode.run_costs(float(batch), means, cpu, beside, tail, launch)

    def _warning_range(
        self, costs: RunCosts, n: int, ctx_max: int, beyond: bool, longest_limit: float
    ) -> RunCosts:
        """`costs`, warning (once a range) at each step beyond the profile's range."""
        for s, step in enumerate(costs):
            if beyond or ctx_max + s + 1 > longest_limit:
                self._warn_range(n, n, ctx_max + s + 1)
            yield step

    def _drafts_proposed(self, out: SchedulerOutput) -> int:
        k = self.num_speculative_tokens
        if k and out.num_proposals is not None:  # varlen: the drafter proposes fewer
            k = out.num_proposals
        return k

    def _measure(self, out: SchedulerOutput, num_drafts: int) -> _Step | None:
        """What the fits read of `out` followed by the drafter proposing `num_drafts`
        drafts (0: as many as a request of the step verifies; none: no drafter), in one
        pass over its requests (this runs for every simulated step); None for an empty
        step. Warns once where the step lies beyond the profile's range."""
        scheduled = out.scheduled
        if not scheduled:
            return None
        tokens = longest = ctx_max = ctx_sum = prompts = span = chunk_pairs = decodes = 0
        dec_ctx = -1  # (no decode)
        eager = False
        for r in scheduled:
            q, c = r.num_tokens, r.num_computed_tokens
            tokens += q
            if q > 1:
                eager = True
            if c + q > longest:
                longest = c + q
            if c > ctx_max:
                ctx_max = c
            ctx_sum += c
            if r.is_prompt:
                prompts += 1
                if q == 1:  # (a one-token chunk decodes: absorbed path)
                    decodes += 1
                    if c > dec_ctx:
                        dec_ctx = c
                else:
                    chunk_pairs += q * (2 * c + q)
                    if c + q > span:
                        span = c + q
            else:
                decodes += 1
                if c > dec_ctx:
                    dec_ctx = c
        lim = self._limits
        m = _EXTRAPOLATION_MARGIN
        n = len(scheduled)
        if tokens > lim["tokens"] * m or n > lim["reqs"] * m or longest > lim["context"] * m:
            self._warn_range(tokens, n, longest)
        mean = max(1.0, ctx_sum / n)
        effective = max(1.0, float(ctx_max)) if n <= self._one_wave else mean
        if eager and not num_drafts:  # drafts to verify: a drafter proposed them
            num_drafts = max(len(r.draft_token_ids) for r in scheduled)
        return _Step(
            out,
            float(n),
            effective,
            mean,
            eager,
            num_drafts,
            (tokens, prompts, self._decode_piece(dec_ctx, decodes, eager),
             self._wave_keys(span, chunk_pairs), self._graph_tokens(tokens, span > 0)),
        )  # fmt: skip

    def price_point(self, out: SchedulerOutput, num_drafts: int = 0) -> float:
        """A profile point's price (`num_drafts`: its drafter's). A decode point's batch is
        already the surface's coordinate (a grid point's graph is its own size; a
        log-fitted point's batch is its steps' requests and one row more where their
        graph padded them), so it is read there, not padded again as an engine's step."""
        step = self._measure(out, num_drafts)
        if step is None:
            return 0.0
        if step.num_drafts or step.eager or not self._decode.ready:
            return self._price(step)
        return self._plain_decode(step.n, step.effective, step.mean, padded=False)

    def _price(self, step: _Step) -> float:
        if step.num_drafts:
            return self._price_speculative(step)
        if not step.eager and self._decode.ready:
            return self._plain_decode(step.n, step.effective, step.mean)
        return self._physics_of(step)

    def _plain_decode(self, n: float, effective: float, mean: float, padded: bool = True) -> float:
        """A pure-decode step of n requests (the surface's effective context, their mean
        context): one wave of split-KV, the surface's uniform batch at the mean (its
        requests and, where the graph pads them, one row more: `one_wave_decode`) and
        the longest request's pieces past it (`_longest_pieces`), never more than the
        uniform batch at the longest context (where every request's pieces are as long as
        its); past a wave, the surface alone (the padding rows' pieces are empty: the
        requests set the time).
        padded False: n is already the surface's batch (a profile point's, its graph's
        own size)."""
        if n > self._one_wave:
            return self._decode.predict_at(n, effective)
        seqs = self._max_num_seqs if padded else 0  # (0: the rows as they are)
        batch, splits = one_wave_decode(int(n), seqs, self._heads, self._sms)
        surface = self._decode
        waits = surface.predict_at(batch, mean) + self._longest_pieces(splits, effective, mean)
        return surface.capped(batch, waits, effective)

    def _longest_pieces(self, splits: int, longest: float, mean: float) -> float:
        """Seconds the longest request's pieces run on alone after a one-wave decode
        batch's uniform part (its keys past the mean, over the `splits` pieces each
        context is cut into for the graph's rows)."""
        return self._piece_key_s * (longest - mean) / splits

    def _solo_piece_key_seconds(self) -> float:
        """Seconds a decode attention piece takes a key of its context with the GPU to
        itself: one request's decode (its pieces alone on the SMs), its time over the
        surface's contexts, a key of each of its pieces. A grid whose smallest batch is
        more than one (a log-fitted one: batches are bucket medians) reads the batch-1
        row the surface extrapolates by its physics, not a contended row. 0.0 without a
        surface or waves (a CPU's batch costs its contexts' sum: the surface's mean
        context)."""
        surface = self._decode
        if not surface.ready or not self._one_wave:
            return 0.0
        lo, hi = float(surface.contexts[0]), float(surface.contexts[-1])
        with warnings.catch_warnings():  # (a batch below the grid: nothing to warn about)
            warnings.simplefilter("ignore")
            per_key = (surface.predict_at(1.0, hi) - surface.predict_at(1.0, lo)) / (hi - lo)
        return per_key * decode_splits(graph_batch(1), self._heads, self._sms)

    def _price_speculative(self, step: _Step) -> float:
        """A speculating engine's step: the target part (verify surfaces for uniform
        decode-like steps, else the plain fit's physics), then the drafter's."""
        out, n, effective = step.out, step.n, step.effective
        drafts = 0
        uniform = True  # no prompt chunk, every request its token plus its drafts
        for r in out.scheduled:
            d = len(r.draft_token_ids)
            drafts += d
            if r.is_prompt or r.num_tokens != 1 + d:
                uniform = False
        spec = self._spec
        if not spec.ready:
            self._warn_no_verify_points(step.num_drafts)
        if uniform and self._decode.ready:

            def decode() -> float:
                return self._decode.predict_at(n, effective)

            if spec.ready:
                if drafts / n > spec.profile_drafts:
                    self._warn_beyond_drafts(drafts / n)
                target = spec.target_time(out, n, effective, drafts / n, decode)
            else:
                target = fallback_target(self._analytic, out, decode())
        else:
            target = self._physics_of(step)
            if drafts and self._verify_launch and spec.ready and spec.verify_physics.ready:
                target += self._verify_attention_beside_chunks(step)
        if spec.ready:
            return target + spec.drafter_time(out, step.num_drafts)
        return target + self._analytic.drafter_seconds(out, step.num_drafts)

    def _verify_attention_beside_chunks(self, step: _Step) -> float:
        """What a step's decode attention costs more when its decodes verify drafts
        beside prompt chunks (`_physics_of(step)` first: its features): the decode
        kernel then runs its verify launch for every decode row, so their attention is
        the verify physics' (`VerifyPhysics.attention_time`) in place of the plain fit's
        decode terms (attn_dec, decode_max_context), which were fitted on decode steps."""
        features, coef = step.features, self._coef
        assert features is not None
        plain = features[_DECODE_MAX_CONTEXT] * coef[_DECODE_MAX_CONTEXT]
        plain += features[_ATTN_DEC] * coef[_ATTN_DEC]
        return self._spec.verify_physics.attention_time(step.out) - plain

    def _physics(self, out: SchedulerOutput) -> float:
        return sum(map(mul, self.features(out), self._coef))

    def _uniform_decode_physics(self, batch: int, context: int) -> float:
        """`_physics` of `batch` requests decoding one token each at `context` (a graph
        step: `features`' terms of that step, its sums `decode_sums`), without building
        the step: the decode surface prices one at each new context of a run past its
        grid."""
        head = self._head(
            False, batch, 0, batch, self._decode_piece(context, batch, False), self._wave_keys(0, 0)
        )
        # (no prompt chunk: no piecewise graph's padded rows, `_graph_tokens` 0)
        groups = self._analytic.group_seconds_of(decode_sums(batch, batch * context), None, 0)
        return sum(map(mul, head + groups, self._coef))

    def _physics_of(self, step: _Step) -> float:
        """`_physics(step.out)`, its features computed once for both fits."""
        features = step.features
        if features is None:
            tokens, prompts, piece, wave, rows = step.head
            head = self._head(
                step.eager, len(step.out.scheduled), prompts, tokens, piece, wave, rows
            )
            features = step.features = head + self._analytic.group_seconds(step.out, rows)
        return sum(map(mul, features, self._coef))

    @staticmethod
    def _eager(out: SchedulerOutput) -> bool:
        """The real runner replays a graph only for pure decode (one token per request)."""
        return any(r.num_tokens > 1 for r in out.scheduled)

    def cpu_time(self, out: SchedulerOutput) -> float:
        if not out.scheduled:
            return 0.0
        a, b, c = self._host
        return a + b * len(out.scheduled) + c * out.num_batched_tokens

    @property
    def grammar_mask_per_token_s(self) -> float:
        """The profile's steps had no grammars: their masks cost what the coefficients say."""
        return self._analytic.grammar_mask_per_token_s

    # --- features ----------------------------------------------------------------

    def features(self, out: SchedulerOutput) -> list[float]:
        """The FEATURES of a step, in order, in one pass over its requests (the fit's
        points, synthetic steps; a priced step reads its head from `_measure`'s pass)."""
        eager = False
        prompts = tokens = span = chunk_pairs = decodes = 0
        dec_ctx = -1  # (no decode)
        for r in out.scheduled:
            q, c = r.num_tokens, r.num_computed_tokens
            tokens += q
            if q > 1:
                eager = True
            if q == 1 or not r.is_prompt:  # a decode (verifying drafts or not): absorbed path
                decodes += 1
                if c > dec_ctx:
                    dec_ctx = c
            if r.is_prompt:
                prompts += 1
                if q > 1:
                    chunk_pairs += q * (2 * c + q)
                    if c + q > span:
                        span = c + q
        wave = self._wave_keys(span, chunk_pairs)
        piece = self._decode_piece(dec_ctx, decodes, eager)
        rows = self._graph_tokens(tokens, span > 0)
        head = self._head(eager, len(out.scheduled), prompts, tokens, piece, wave, rows)
        return head + self._analytic.group_seconds(out, rows)

    def _graph_tokens(self, tokens: int, chunked: bool) -> int:
        """The rows a step's projections and experts run over where it carries a prompt
        chunk (`chunked`): its piecewise graph's token bucket (`token_bucket`) up to the
        profile's piecewise_max_tokens, its own tokens past it (eager); 0 (its own) for
        a step without a chunk, which replays a decode or verify graph padded by
        requests, not tokens."""
        if not chunked or tokens > self._piecewise_max:
            return 0
        return token_bucket(tokens, self._piecewise_max)

    def _wave_keys(self, span: int, chunk_pairs: int) -> float:
        """The `prefill_wave` feature of prompt chunks whose longest reaches `span` keys
        (its cached prefix and itself) and whose (query row, key) pairs sum to
        `chunk_pairs` / 2 (each chunk's q * (2 * context + q): causal, so a row sees
        its prefix and the rows before it)."""
        share = self._wave_share
        return max(float(span), chunk_pairs * share) if share else 0.0

    def _decode_piece(self, dec_ctx: int, decodes: int, eager: bool) -> float:
        """The keys of the longest decode context's piece (`decode_max_context`): that
        context over the pieces split-KV cuts each into for the step's decode rows (its
        `decodes`, or a pure-decode step's graph's rows; on a host CPU, no pieces: the
        context); -1 where none decodes."""
        if dec_ctx < 0 or not self._sms:
            return float(dec_ctx)
        rows = decodes
        if not eager and self._max_num_seqs:
            rows = graph_batch(decodes, self._max_num_seqs)
        return dec_ctx / decode_splits(rows, self._heads, self._sms)

    def _head(
        self,
        eager: bool,
        n: int,
        prompts: int,
        tokens: int,
        piece: float,
        wave: float,
        rows: int = 0,
    ) -> list[float]:
        """The FEATURES before the op groups, of a step of n requests; piece: the keys of
        its longest decode context's piece (`_decode_piece`), -1 where none decodes; rows:
        its piecewise graph's padded rows (`_graph_tokens`), 0 without a prompt chunk.
        A lone chunk (n = 1: one request's prompt, the first step after the engine idled)
        counts the rows for its tokens: the runner runs every row between attention
        layers, and where a grid's lone chunks are buckets' sizes nothing else tells the
        fit what a chunk between buckets costs (priced by its tokens, such chunks came
        out several percent under the real engine's). Its attention stays its own
        tokens' (`wave`, the op groups). A mixed step's points lie between buckets, and
        its fit reads them as they are."""
        piecewise = eager and tokens <= self._piecewise_max
        return [
            0.0 if eager else 1.0,
            1.0 if eager else 0.0,
            1.0 if eager and not piecewise else 0.0,
            1.0 if eager and piece >= 0 else 0.0,
            float(n),
            float(prompts),
            float(rows if n == 1 and rows > tokens else tokens),
            piece if piece > 0 else 0.0,
            wave,
        ]

    def _check_range(self, out: SchedulerOutput) -> None:
        lim, m = self._limits, _EXTRAPOLATION_MARGIN
        tokens, reqs = out.num_batched_tokens, len(out.scheduled)
        ctx = max(r.num_computed_tokens + r.num_tokens for r in out.scheduled)
        if tokens <= lim["tokens"] * m and reqs <= lim["reqs"] * m and ctx <= lim["context"] * m:
            return
        self._warn_range(tokens, reqs, ctx)

    def _warn_no_verify_points(self, k: int, stacklevel: int = 5) -> None:
        if "verify" in self._warned:
            return
        self._warned.add("verify")
        warnings.warn(
            f"profiled cost model ({self.profile_name}): the engine speculates ({k} drafts "
            "a step) but the profile has no verify points nor drafter times (measure them "
            f"with `deepinfer profile --num-speculative-tokens {k}`, plus --add-mtp-layer for "
            "a model that ships none); verify steps and the "
            "MTP drafter are priced by the analytic physics (verify steps: the measured "
            "decode step scaled by the analytic ratio)",
            stacklevel=stacklevel,
        )

    def _warn_beyond_drafts(self, mean: float) -> None:
        if "drafts" in self._warned:
            return
        self._warned.add("drafts")
        warnings.warn(
            f"profiled cost model ({self.profile_name}): a step verifies {mean:.1f} drafts a "
            f"request, beyond the profile's verify points (at most "
            f"{self._spec.profile_drafts}); scaled from those by the analytic physics",
            stacklevel=5,
        )

    def _warn_range(self, tokens: int, reqs: int, ctx: int) -> None:
        seen = {"tokens": tokens, "reqs": reqs, "context": ctx}
        for key, value in seen.items():
            limit = self._limits[key]
            if value > limit * _EXTRAPOLATION_MARGIN and key not in self._warned:
                self._warned.add(key)
                warnings.warn(
                    f"profiled cost model ({self.profile_name}): a step with {value} {key} "
                    f"extrapolates beyond the profile (largest measured: {limit})",
                    stacklevel=4,
                )


def _means(n: int, ctx_sum: int, horizon: int) -> Iterable[float]:
    """The contexts' mean of each step of a decode batch (n requests, `ctx_sum` keys at
    its first step, one more a request a step), at least 1.0, as `_measure` computes it."""
    if ctx_sum >= n:
        return map(truediv, range(ctx_sum, ctx_sum + n * horizon, n), repeat(n))
    return (max(1.0, (ctx_sum + n * s) / n) for s in range(horizon))
