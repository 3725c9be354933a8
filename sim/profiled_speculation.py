"""The steps of a speculating engine, priced from a profile's speculative points.

`deepinfer profile --num-speculative-tokens K` measures, beside the plain grid, steps
each followed by the MTP drafter's proposal of K drafts (the real engine drafts after
every step once it speculates), the drafter's share timed apart (`draft_s`):

  verify        B requests of 1 + k tokens over a context, k = 1..K
  spec_decode   B requests of one token (no drafts to verify yet)
  spec_prefill  a prompt chunk (the drafter's first pass covers all its positions)

A step is priced as its target part plus the drafter's:

  target   uniform decode-like steps (no prompt chunk, every request 1 + its drafts)
           from the measured grids: the plain decode surface at k = 0, one verify
           surface (measured minus the drafter) per k, linear in the step's mean k
           between them (each k as measured: fewer drafts can cost more, when
           only 1 + K tokens a request run in graphs). A surface's unmeasured nodes
           and the steps beyond its grid are scaled by the verify physics
           (`VerifyPhysics`), fitted on the verify points alone; past the profile's K
           the analytic model scales the K surface. Other steps: the plain fit's
           physics, the attention of decodes verifying beside prompt chunks the
           verify physics' (`VerifyPhysics.attention_time`: they take the verify launch).
  drafter  a non-negative fit of `draft_s` on the analytic model's drafter parts (passes,
           pass 1 over the step's tokens, the chained passes, drafts proposed), so it
           follows the engine's K even where the profile drafted another number.

The verify physics is its own fit because a verify step is not a decode step with more
tokens: its requests' 1 + k query rows take the verify path of the decode attention
kernel, whose time over the context grows faster than a decode step's (and no faster
for k = 3 than for k = 1: the KV is read once a request, not once a query row), so the plain fit, fitted on decode and prompt steps,
under-prices verify steps as batch and context grow.

A profile without verify points cannot price these: `ProfiledCostModel` then warns and
falls back to the analytic physics (fallback_target, AnalyticCostModel.drafter_seconds).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from deepinfer.outputs import SchedulerOutput
from sim.analytic_cost_model import AnalyticCostModel
from sim.profile_fit import StepSurface, nnls_relative, step_seconds


class SpeculativeSteps:
    """Verify surfaces and the drafter's fit from a profile's speculative points."""

    def __init__(
        self,
        points: list[dict[str, Any]],
        outs: list[SchedulerOutput],
        analytic: AnalyticCostModel,
        physics: Callable[[SchedulerOutput], float],
        graphed: bool = True,
        pipelined: bool = False,
        *,
        num_heads: int = 0,
        num_sms: int = 0,
    ) -> None:
        """graphed: the profile's engine ran CUDA graphs, which hold only verify steps of
        1 + K tokens a request (so fewer drafts may cost more); else (eager, the CPU)
        the surfaces are kept non-decreasing in k against measurement noise.
        pipelined (async scheduling): verify steps chain on the step in flight, so their
        surfaces are fitted to the points' pipelined times (the runner's host work hidden)
        less the drafter's. num_heads, num_sms: the model's attention heads and the GPU's
        SMs, which set the splits of a verify step's attention (`VerifyPhysics`; 0 SMs:
        a host CPU, no splits)."""
        self._analytic = analytic
        self._monotone = not graphed
        spec = [(p, o) for p, o in zip(points, outs) if p.get("drafter")]
        # Drafts the profile's drafter proposed (verify surfaces exist for k = 1..this).
        self.profile_drafts = max((int(p["drafter"]) for p, _ in spec), default=0)
        self.surfaces: dict[int, StepSurface] = {}
        # Uniform verify points: their drafts a request, step and target part's time.
        verify = [
            (_uniform_k(o), o, step_seconds(p, pipelined) - p["draft_s"])
            for p, o in spec
            if p["kind"] == "verify" and _uniform_k(o) > 0
        ]  # fmt: skip
        self.verify_physics = VerifyPhysics(
            [o for _, o, _ in verify],
            np.array([t for _, _, t in verify]),
            analytic,
            num_heads=num_heads,
            num_sms=num_sms,
        )
        # (too few verify points to fit it: the plain fit's physics scales instead)
        self._scale = self.verify_physics if self.verify_physics.ready else physics
        for k in range(1, self.profile_drafts + 1):
            outs_k = [o for kk, o, _ in verify if kk == k]
            target = np.array([t for kk, _, t in verify if kk == k], dtype=float)
            surface = StepSurface(outs_k, target, self._scale, drafts=k)
            if not surface.ready:
                self.surfaces = {}
                break
            self.surfaces[k] = surface
        self.ready = bool(self.surfaces)
        if not self.ready:
            return
        x = np.array([analytic.drafter_parts(o, int(p["drafter"])) for p, o in spec])
        y = np.array([p["draft_s"] for p, _ in spec], dtype=float)
        self.drafter_coef = [float(c) for c in nnls_relative(x, y)]
        if self._monotone:
            ks = sorted(self.surfaces)
            for lo, hi in zip(ks, ks[1:]):
                self.surfaces[hi].raise_to(self.surfaces[lo])
        # With graphs the surfaces stay as measured: a step verifying K drafts replays a
        # graph and may be faster than one verifying fewer, which runs eagerly, so
        # raising the K surface to a smaller k's would overprice it.

    def drafter_time(self, out: SchedulerOutput, num_drafts: int) -> float:
        parts = self._analytic.drafter_parts(out, num_drafts)
        return sum(f * c for f, c in zip(parts, self.drafter_coef))

    def target_time(
        self,
        out: SchedulerOutput,
        batch: float,
        context: float,
        mean_drafts: float,
        decode: Callable[[], float],
    ) -> float:
        """A uniform decode-like step of `batch` requests verifying `mean_drafts` drafts
        each on average, at the surfaces' effective `context`; decode(): the plain
        decode surface's time of the same batch (k = 0)."""
        top = self.profile_drafts
        hi = min(math.ceil(mean_drafts), top)
        values = [decode()]
        for k in range(1, hi + 1):
            value = self.surfaces[k].predict_at(batch, context)
            values.append(max(values[-1], value) if self._monotone else value)
        if mean_drafts > top:  # beyond the profile: the analytic ratio to k <= top
            capped = self._analytic.target_time(capped_drafts(out, top))
            return values[top] * max(1.0, self._analytic.target_time(out) / capped)
        lo = math.floor(mean_drafts)
        u = mean_drafts - lo
        return values[lo] if u == 0 else (1 - u) * values[lo] + u * values[lo + 1]


_MAX_SPLITS = 64  # kernels/mla_decode.py MAX_SPLITS


class VerifyPhysics:
    """The target time of a verify step (the drafter apart) as a non-negative combination
    of features that follow its physics, fitted on a profile's verify points (relative
    error, `nnls_relative`):

      fixed, reqs, tokens   the step's fixed cost (a replayed graph), per-request and
                            per-token work the groups below do not price
      dense, experts,       the analytic model's seconds of the matmuls over the step's
      lm_head               tokens (every request's 1 + k) and of the logits
      kv_read               the decode attention's keys, each request's context once (its
                            latent KV is read once for all of its query rows)
      longest_piece         the longest context over the pieces split-KV cuts it into: one
                            wave of the decode attention kernel waits for its longest
                            piece, and the pieces a request gets fall as the batch grows
                            (SMs over the programs, a program a request's query rows and
                            a block of heads, at most 64: kernels/mla_decode.py)
      pairs                 query rows times their context (the attention's FLOPs)

    It prices the verify surfaces' unmeasured nodes and steps beyond their grids
    (`StepSurface` scales a measured node by its ratio). Not the steps verifying more
    drafts than the profile measured: fitted on k <= K alone, its tokens' terms say
    little of a larger k (the analytic model's ratio scales those). With fewer verify points than features, a point whose
    drafter took all its time, or a fit that prices a point at zero, there is none
    (`ready` is False, every coefficient 0.0): the plain fit's physics scales instead."""

    FEATURES = ("fixed", "reqs", "tokens", "dense", "experts", "lm_head", "kv_read",
                "longest_piece", "pairs")  # fmt: skip

    def __init__(
        self,
        outs: list[SchedulerOutput],
        times: np.ndarray,
        analytic: AnalyticCostModel,
        *,
        num_heads: int = 0,
        num_sms: int = 0,
    ) -> None:
        """outs: the verify points' steps; times: their target seconds (each point's time
        less its drafter's), [len(outs)]; num_heads, num_sms: the model's attention
        heads and the GPU's SMs (0: a host CPU, whose attention splits no context)."""
        self._analytic = analytic
        self._num_sms = num_sms
        # The decode kernel's verify launch (kernels/mla_decode.py `default_config`, a
        # multi-query step): up to 16 heads, one block of them and 4 query rows of a
        # request a program; more heads, blocks of 64 and a row a program.
        self._rows_per_program = 4 if num_heads <= 16 else 1
        self._head_blocks = 1 if num_heads <= 16 else -(-num_heads // 64)
        times = np.asarray(times, dtype=float)
        # (a target part at or below zero: a drafter's time as long as its step's)
        self.ready = len(outs) >= len(self.FEATURES) and bool(np.all(times > 0))
        self.coef = [0.0] * len(self.FEATURES)
        if self.ready:
            x = np.array([self.features(o) for o in outs], dtype=float)
            coef = nnls_relative(x, times)
            # A fit that prices a point at zero cannot scale from it.
            self.ready = bool(np.all(x @ coef > 0))
            if self.ready:
                self.coef = [float(c) for c in coef]

    def features(self, out: SchedulerOutput) -> list[float]:
        """The FEATURES of `out`, in order (contexts in tokens)."""
        tokens = kv_read = longest = pairs = programs = 0
        rows = self._rows_per_program
        for r in out.scheduled:
            q, c = r.num_tokens, r.num_computed_tokens
            tokens += q
            kv_read += c
            pairs += q * c
            programs += -(-q // rows)
            if c > longest:
                longest = c
        dense, experts, _, _, lm_head = self._analytic.group_seconds(out)
        return [1.0, float(len(out.scheduled)), float(tokens), dense, experts, lm_head,
                float(kv_read), longest / self.splits(programs), float(pairs)]  # fmt: skip

    def attention_time(self, out: SchedulerOutput) -> float:
        """The attention terms alone (kv_read, longest_piece, pairs) of `out`'s decode
        rows, verifying or not (a step's prompt chunks left out: their attention is the
        prefill kernel's)."""
        kv_read = longest = pairs = programs = 0
        rows = self._rows_per_program
        for r in out.scheduled:
            q, c = r.num_tokens, r.num_computed_tokens
            if r.is_prompt and q > 1:
                continue
            kv_read += c
            pairs += q * c
            programs += -(-q // rows)
            if c > longest:
                longest = c
        *_, c_kv, c_longest, c_pairs = self.coef
        return c_kv * kv_read + c_longest * longest / self.splits(programs) + c_pairs * pairs

    def splits(self, programs: int) -> int:
        """The pieces split-KV cuts each context into beside `programs` busy programs
        (one wave of the verify launch's one program an SM, at most 64; 1 on a CPU)."""
        if not self._num_sms:
            return 1
        return max(1, min(self._num_sms // max(programs * self._head_blocks, 1), _MAX_SPLITS))

    def __call__(self, out: SchedulerOutput) -> float:
        return sum(f * c for f, c in zip(self.features(out), self.coef))


def fallback_target(analytic: AnalyticCostModel, out: SchedulerOutput, decode: float) -> float:
    """A uniform decode-like step without verify points: the measured decode step of its
    requests (`decode`) scaled by the analytic model's ratio of this step to that one."""
    ratio = analytic.target_time(out) / analytic.target_time(capped_drafts(out, 0))
    return decode * max(1.0, ratio)


def capped_drafts(out: SchedulerOutput, cap: int) -> SchedulerOutput:
    """`out` with each decode-like request verifying at most `cap` of its drafts (its
    query shortened to match); contexts as they are."""
    scheduled = []
    for r in out.scheduled:
        d = len(r.draft_token_ids)
        if d > cap:
            r = replace(
                r, num_tokens=r.num_tokens - (d - cap), draft_token_ids=r.draft_token_ids[:cap]
            )
        scheduled.append(r)
    return SchedulerOutput(step_id=out.step_id, scheduled=scheduled)


def _uniform_k(out: SchedulerOutput) -> int:
    """The drafts every request of a verify point verifies (-1 if they differ)."""
    ks = {len(r.draft_token_ids) for r in out.scheduled}
    return ks.pop() if len(ks) == 1 else -1
