"""Fitting measured steps: the profiled cost models' building blocks.

StepSurface holds measured times of uniform decode-like steps (B requests, each of the
same query: one token, or 1 + k when verifying k drafts) on a batch x context grid, made
monotone and interpolated in log space; nnls_relative fits non-negative coefficients on
relative error.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from sim.fit_cache import memo_solve

ONE_WAVE_BATCH = 256  # decode batches up to this many requests run as one wave of splits
# The decode attention kernel's launch (kernels/mla_decode.py): at most this many pieces a
# context, and its resident programs an SM (up to 16 heads: one block of 16 heads a
# program, two programs an SM; more heads: blocks of 64, one an SM).
DECODE_MAX_SPLITS = 64
# The batch sizes the real runner captures decode graphs at (executors/cuda_graphs.py
# `default_capture_sizes`): a decode step replays the smallest one that holds its batch,
# padded with one-token rows.
_GRAPH_BATCHES = [1, 2, 4, *range(8, 65, 8), *range(96, 257, 32)]
# The token buckets piecewise graphs are captured at (executors/piecewise_graphs.py
# `default_token_buckets`, up to their top: min(max_num_batched_tokens, PIECEWISE_LIMIT)).
PIECEWISE_LIMIT = 8192
_TOKEN_BUCKETS = [16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
                  *range(2048, 8193, 512)]  # fmt: skip
# Query rows a prefill attention program holds (kernels/mla_prefill.py, 16-bit tiles).
PREFILL_QUERY_TILE = 128
_SYNTHETIC_CACHE_SIZE = 1 << 16  # (batch, context) pairs a surface keeps the physics of


def graph_batch(num_reqs: int, max_num_seqs: int = 256) -> int:
    """The rows of the CUDA graph a pure-decode step of `num_reqs` requests replays on an
    engine of `max_num_seqs`: the smallest size its runner captures that holds them
    (sizes below max_num_seqs, then max_num_seqs itself; past 256 steps of 64)."""
    i = bisect.bisect_left(_GRAPH_BATCHES, num_reqs)
    size = _GRAPH_BATCHES[i] if i < len(_GRAPH_BATCHES) else -(-num_reqs // 64) * 64
    return min(size, max_num_seqs) if num_reqs <= max_num_seqs else size


def one_wave_decode(
    num_reqs: int, max_num_seqs: int, num_heads: int, num_sms: int
) -> tuple[int, int]:
    """How a pure-decode step of `num_reqs` requests that fits one wave of split-KV runs in
    the graph it replays (`graph_batch`; max_num_seqs 0: a runner without graphs, whose
    rows are its requests): (the decode surface's batch, the pieces the attention cuts
    each context into, those chosen for the graph's rows).

    The graph's padding rows are alike (one token, no context): the projections read
    their weights once for all rows, and the experts see the padding as one token, so
    the step costs the surface's batch of its requests and one row more (none where the
    graph is its own size), not the graph's whole batch."""
    rows = graph_batch(num_reqs, max_num_seqs) if max_num_seqs else num_reqs
    batch = num_reqs + 1 if rows > num_reqs else num_reqs
    return batch, decode_splits(rows, num_heads, num_sms)


def token_bucket(tokens: int, top: int) -> int:
    """The rows of the piecewise CUDA graph a non-decode step of `tokens` tokens replays
    (executors/piecewise_graphs.py `default_token_buckets`, up to `top`): the smallest
    bucket that holds them, the projections and experts run over its padded rows."""
    for size in _TOKEN_BUCKETS:
        if size >= top:
            return top
        if size >= tokens:
            return size
    return top


def decode_splits(rows: int, num_heads: int, num_sms: int) -> int:
    """The pieces split-KV decode attention cuts each context into for a batch of `rows`
    query rows (kernels/mla_decode.py `choose_num_splits` with `default_config`): as many
    as fill one wave of resident programs, at most DECODE_MAX_SPLITS (its floor of 64
    keys a piece never binds in a graph, whose block table is the graph's width; an
    eager step's table is as wide as its longest request, where the floor can bind for
    short contexts: not modelled)."""
    if num_heads <= 16:
        head_blocks, slots = 1, 2 * num_sms
    else:
        head_blocks, slots = -(-num_heads // 64), num_sms
    return max(1, min(slots // max(rows * head_blocks, 1), DECODE_MAX_SPLITS))


def step_seconds(point: dict[str, Any], pipelined: bool, device: bool = False) -> float:
    """A profile point's step time: its median, or (async scheduling) its pipelined time,
    which cannot exceed the median: launching a step while the one before runs only
    hides host work, so a pipelined median above it is noise from its few rounds and
    the median stands. device (with pipelined): the device's own time of the step
    (`device_s`, executors/profiler.py), which the pipelined time bounds, where the
    point has it (else the pipelined time: a step whose launch waited on the device)."""
    if pipelined:
        seconds = min(float(point["pipelined_s"]), float(point["median_s"]))
        own = point.get("device_s") if device else None
        return seconds if own is None or own > seconds else float(own)
    return float(point["median_s"])


def shape_output(groups: list[list[Any]]) -> SchedulerOutput:
    """A SchedulerOutput of a profile point's shape: [count, query, context, is_prompt]
    and, for verify requests, the drafts each verifies (the last of its query tokens)."""
    scheduled: list[ScheduledRequest] = []
    for count, q, ctx, is_prompt, *rest in groups:
        drafts = list(range(int(rest[0]))) if rest else []
        for i in range(int(count)):
            scheduled.append(ScheduledRequest(
                req_id=f"{len(scheduled)}.{i}", num_tokens=int(q), num_computed_tokens=int(ctx),
                is_prompt=bool(is_prompt), will_sample=True, new_block_ids=[],
                draft_token_ids=drafts,
            ))  # fmt: skip
    return SchedulerOutput(step_id=0, scheduled=scheduled)


class StepSurface:
    """Measured times of uniform decode-like steps (every request `drafts` + 1 tokens:
    pure decode, or verifying that many drafts) on a batch x context grid: monotone,
    interpolated in (log2 batch, log2 effective context); the physics model scales
    beyond the grid."""

    def __init__(
        self,
        outs: list[SchedulerOutput],
        times: np.ndarray,
        physics: Callable[[SchedulerOutput], float],
        drafts: int = 0,
        uniform: Callable[[int, int], float] | None = None,
    ) -> None:
        self._physics = physics
        self.drafts = drafts
        # physics of the uniform decode step of (batch >= 1, context) without building
        # it, where the caller has it: equal to `physics(self._synthetic(batch, context))`
        assert uniform is None or drafts == 0, "a closed form of decode steps only"
        self._uniform = uniform
        self._physics_of_synthetic: dict[tuple[int, int], float] = {}
        coords = [self._coords(o) for o in outs]
        self.batches = np.array(sorted({b for b, _ in coords}), dtype=float)
        self.contexts = np.array(sorted({c for _, c in coords}), dtype=float)
        self.ready = len(self.batches) >= 2 and len(self.contexts) >= 2
        if not self.ready:
            return
        grid = np.full((len(self.batches), len(self.contexts)), np.nan)
        for (b, c), t in zip(coords, times):
            grid[np.searchsorted(self.batches, b), np.searchsorted(self.contexts, c)] = t
        for i, b in enumerate(self.batches):  # an unmeasured node: physics from a neighbour
            for j, c in enumerate(self.contexts):
                if np.isnan(grid[i, j]):
                    grid[i, j] = self._scaled(grid, i, j, b, c)
        self.grid = monotone(monotone(grid, axis=0), axis=1)
        self._grid = self.grid.tolist()
        self._log_batches = [math.log2(b) for b in self.batches]
        self._log_contexts = [math.log2(c) for c in self.contexts]
        self._bounds = (
            float(self.batches[0]),
            float(self.batches[-1]),
            float(self.contexts[0]),
            float(self.contexts[-1]),
        )

    @staticmethod
    def _coords(out: SchedulerOutput) -> tuple[float, float]:
        """(batch, effective context). Split-KV decode cuts every request into as many
        pieces as fill one wave of the GPU, so while the batch fits one wave the step
        waits for the longest request: its context counts. Beyond, the mean does."""
        n = len(out.scheduled)
        ctx = [r.num_computed_tokens for r in out.scheduled]
        effective = max(ctx) if n <= ONE_WAVE_BATCH else sum(ctx) / n
        return float(n), max(1.0, float(effective))

    def _synthetic(self, batch: float, context: float) -> SchedulerOutput:
        """The uniform step of (batch, context), each request verifying `drafts` drafts:
        one request object `round(batch)` times over (no price reads a request's id)."""
        k = self.drafts
        one = shape_output([[1, 1 + k, round(context), False, k]]).scheduled
        return SchedulerOutput(step_id=0, scheduled=one * round(batch))

    def _scaled(self, grid: np.ndarray, i: int, j: int, b: float, c: float) -> float:
        present = [
            (abs(i - ii) + abs(j - jj), ii, jj)
            for ii in range(grid.shape[0])
            for jj in range(grid.shape[1])
            if not np.isnan(grid[ii, jj])
        ]
        _, ii, jj = min(present)
        ref = self._physics(self._synthetic(self.batches[ii], self.contexts[jj]))
        return float(grid[ii, jj] * self._physics(self._synthetic(b, c)) / ref)

    def raise_to(self, other: StepSurface) -> None:
        """Never below `other` where both measured the same nodes (a surface of more
        drafts to verify over one of fewer: noise must not make more work cheaper)."""
        if np.array_equal(self.batches, other.batches) and np.array_equal(
            self.contexts, other.contexts
        ):
            self.grid = np.maximum(self.grid, other.grid)
            self._grid = self.grid.tolist()

    def predict(self, out: SchedulerOutput) -> float:
        return self.predict_at(*self._coords(out))

    def predict_at(self, b: float, c: float) -> float:
        """The step time at (batch, effective context)."""
        b_lo, b_hi, c_lo, c_hi = self._bounds
        bc = b_lo if b < b_lo else b_hi if b > b_hi else b
        cc = c_lo if c < c_lo else c_hi if c > c_hi else c
        value = self._interpolate(bc, cc)
        if bc == b and c < c_lo:
            # Below the grid's contexts, inside its batches: the physics' ratio at the two
            # batch nodes around b, interpolated as the grid is (the physics cuts contexts
            # into the pieces of each graph size, which the grid's batches between nodes
            # do not step through: its ratio read at b itself would fall at a graph's edge).
            i, u = self._batch_cell(b)
            lo, hi = float(self.batches[i]), float(self.batches[i + 1])
            below = self._synthetic_physics(lo, c) / self._synthetic_physics(lo, cc)
            above = self._synthetic_physics(hi, c) / self._synthetic_physics(hi, cc)
            value *= (1 - u) * below + u * above
        elif (bc, cc) != (b, c):
            # Beyond the grid: the physics of the excess, at the same effective context
            # the grid is indexed by. The step's own shape would price the mean context
            # and undo the longest request's wait (one wave: the step waits for it).
            value *= self._synthetic_physics(b, c) / self._synthetic_physics(bc, cc)
        return value

    def _synthetic_physics(self, batch: float, context: float) -> float:
        """`physics` of the synthetic step of (batch, context), both rounded as the step
        is built: a pure function of the rounded pair, kept (a long run beyond the grid
        asks for the same pairs step after step; building a step of `batch` requests each
        time dominated such a run)."""
        key = (round(batch), round(context))
        cached = self._physics_of_synthetic.get(key)
        if cached is None:
            if len(self._physics_of_synthetic) >= _SYNTHETIC_CACHE_SIZE:
                self._physics_of_synthetic.clear()
            if self._uniform is not None and key[0] >= 1:
                cached = self._uniform(*key)
            else:
                cached = self._physics(self._synthetic(batch, context))
            self._physics_of_synthetic[key] = cached
        return cached

    def run_costs(
        self,
        b: float,
        contexts: Iterable[float],
        host: float,
        beside: StepSurface | None,
        tail: tuple[int, float, float, int] | None = None,
        launch: float = 0.0,
    ) -> Iterator[tuple[float, float, float, float]]:
        """A decode run's steps priced on this surface (the cost model's RunCosts): for
        each c of `contexts`, (`host`, `predict_at(b, c)`, how much more
        `beside.predict_at(b, c)` is, at least 0.0; 0.0 without `beside`, `launch`). tail =
        (ctx_max, key_s, beside_key_s, splits) of a one-wave batch (`one_wave_decode`):
        each price also adds its longest request's pieces past c (the contexts' mean),
        `key_s * (longest - c) / splits` with longest = max(1.0, ctx_max + s) at step s,
        capped at the uniform batch at longest (`capped`; the profiled cost model's
        `_plain_decode`), and the beside price its own at beside_key_s on its own surface.
        For a run of steps of one batch: inside the grid the batch's interpolation weights
        are computed once, a context's cell (and the longest context's) is looked up again
        only when it leaves the one before, both surfaces share the weights where their
        grids have the same nodes, and every float operation is `_interpolate`'s and
        `_plain_decode`'s in their order (the same results to the bit)."""
        top, key_s, beside_key_s, splits = (0, 0.0, 0.0, 1) if tail is None else tail
        longest = float(top) - 1.0  # (the step before the first's)
        b_lo, b_hi, c_lo, c_hi = self._bounds
        xb, xc = self._log_batches, self._log_contexts
        shared = beside is None or (
            beside._bounds == self._bounds
            and beside._log_batches == xb
            and beside._log_contexts == xc
        )
        if not b_lo <= b <= b_hi or not shared:
            for c in contexts:
                longest += 1.0
                far = (longest if longest > 1.0 else 1.0) if tail is not None else None
                priced, extra = self._priced_beside(b, c, beside, far, key_s, beside_key_s, splits)
                yield host, priced, extra, launch
            return
        i, u = self._batch_cell(b)
        a = 1 - u
        row0, row1 = self._grid[i], self._grid[i + 1]
        other0, other1 = (row0, row1) if beside is None else (beside._grid[i], beside._grid[i + 1])
        log2 = math.log2
        # The cell (j) of the context before: `lo < lc <= hi` is exactly the log-contexts
        # whose clamped bisect gives it (`_context_cell`).
        lo = hi = x0 = dx = g00 = g10 = g01 = g11 = h00 = h10 = h01 = h11 = 0.0
        # The same for the longest context, whose uniform batch caps a one-wave price.
        flo = fhi = fx0 = fdx = f00 = f10 = f01 = f11 = k00 = k10 = k01 = k11 = 0.0
        for c in contexts:
            longest += 1.0
            far = longest if longest > 1.0 else 1.0
            if c < c_lo or c > c_hi:
                edge = far if tail is not None else None
                priced, extra = self._priced_beside(b, c, beside, edge, key_s, beside_key_s, splits)
                yield host, priced, extra, launch
                continue
            lc = log2(c)
            if not lo < lc <= hi:
                j, lo, hi, x0, dx = self._context_cell(lc)
                g00, g10, g01, g11 = row0[j], row1[j], row0[j + 1], row1[j + 1]
                h00, h10, h01, h11 = other0[j], other1[j], other0[j + 1], other1[j + 1]
            v = (lc - x0) / dx
            w = 1 - v
            aw, uw, av, uv = a * w, u * w, a * v, u * v
            priced = aw * g00 + uw * g10 + av * g01 + uv * g11
            inside = False  # the longest context inside the grid: its cell's weights
            if tail is not None:
                priced = priced + key_s * (far - c) / splits
                if far < c_lo or far > c_hi:
                    uniform = self.capped(b, priced, far)
                else:
                    inside = True
                    lf = log2(far)
                    if not flo < lf <= fhi:
                        j, flo, fhi, fx0, fdx = self._context_cell(lf)
                        f00, f10, f01, f11 = row0[j], row1[j], row0[j + 1], row1[j + 1]
                        k00, k10 = other0[j], other1[j]
                        k01, k11 = other0[j + 1], other1[j + 1]
                    fv = (lf - fx0) / fdx
                    fw = 1 - fv
                    faw, fuw, fav, fuv = a * fw, u * fw, a * fv, u * fv
                    uniform = faw * f00 + fuw * f10 + fav * f01 + fuv * f11
                priced = priced if priced < uniform else uniform
            if beside is None:
                yield host, priced, 0.0, launch
            else:
                other = aw * h00 + uw * h10 + av * h01 + uv * h11
                if tail is not None:
                    other = other + beside_key_s * (far - c) / splits
                    if inside:
                        uniform = faw * k00 + fuw * k10 + fav * k01 + fuv * k11
                    else:
                        uniform = beside.capped(b, other, far)
                    other = other if other < uniform else uniform
                extra = other - priced
                yield host, priced, extra if extra > 0.0 else 0.0, launch

    def _priced_beside(
        self,
        b: float,
        c: float,
        beside: StepSurface | None,
        longest: float | None,
        key_s: float,
        beside_key_s: float,
        splits: int,
    ) -> tuple[float, float]:
        """`run_costs`' step at context c off its fast path: with a tail (longest not
        None), the longest request's pieces past c added and the sum capped at the
        uniform batch at `longest`."""
        priced = self.predict_at(b, c)
        if longest is not None:
            priced = self.capped(b, priced + key_s * (longest - c) / splits, longest)
        if beside is None:
            return priced, 0.0
        other = beside.predict_at(b, c)
        if longest is not None:
            other = beside.capped(b, other + beside_key_s * (longest - c) / splits, longest)
        extra = other - priced
        return priced, extra if extra > 0.0 else 0.0

    def capped(self, b: float, waits: float, longest: float) -> float:
        """`waits` capped at the uniform batch at the `longest` context. Past the grid's
        longest context a price under the uniform batch there is kept as it is: the
        batch at `longest` costs at least as much (past the grid the price is the top
        node's scaled by the physics, whose non-negative fit over features that grow
        with the context does not fall), and pricing it evaluates the physics at every
        new context (each step of a run)."""
        top = self._bounds[3]
        if longest > top and waits <= self.predict_at(b, top):
            return waits
        uniform = self.predict_at(b, longest)
        return waits if waits < uniform else uniform

    def forget_physics(self) -> None:
        """Drop the physics kept per (batch, context): the physics changed (an engine's
        own graphs set after the fit)."""
        self._physics_of_synthetic.clear()

    def _context_cell(self, lc: float) -> tuple[int, float, float, float, float]:
        """The grid's context cell j holding log-context lc (clamped to the first or
        last), the log-contexts (lo, hi] whose clamped lookup gives the same cell (open
        at the grid's ends), and the cell's lower node and width."""
        xc = self._log_contexts
        last = len(xc) - 2
        j = min(max(bisect.bisect_left(xc, lc) - 1, 0), last)
        lo = xc[j] if j else -math.inf
        hi = xc[j + 1] if j < last else math.inf
        return j, lo, hi, xc[j], xc[j + 1] - xc[j]

    def _batch_cell(self, b: float) -> tuple[int, float]:
        """The grid's batch cell holding b (clamped to the first or last) and b's weight
        on its upper node, in log2 batch."""
        xb = self._log_batches
        lb = math.log2(b)
        i = min(max(bisect.bisect_left(xb, lb) - 1, 0), len(xb) - 2)
        return i, (lb - xb[i]) / (xb[i + 1] - xb[i])

    def _interpolate(self, b: float, c: float) -> float:
        lc = math.log2(c)
        i, u = self._batch_cell(b)
        j, _, _, x0, dx = self._context_cell(lc)
        v = (lc - x0) / dx
        g = self._grid
        return (
            (1 - u) * (1 - v) * g[i][j]
            + u * (1 - v) * g[i + 1][j]
            + (1 - u) * v * g[i][j + 1]
            + u * v * g[i + 1][j + 1]
        )


def monotone(values: np.ndarray, axis: int) -> np.ndarray:
    """Non-decreasing along `axis`, as close to the measurements as two envelopes allow:
    the mean of the running maximum and the running minimum from the far end (both
    monotone), so noise is split rather than always rounded up."""
    up = np.maximum.accumulate(values, axis=axis)
    flipped = np.flip(values, axis=axis)
    down = np.flip(np.minimum.accumulate(flipped, axis=axis), axis=axis)
    return (up + down) / 2


def nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the squared relative error of x @ c to y.
    Columns are scaled to unit norm first so that their units do not matter. The result
    is memoised on disk (sim/fit_cache.py)."""
    import scipy  # (its version only: the solver's module is imported on a miss)

    def solve() -> np.ndarray:
        from scipy.optimize import nnls

        w = 1.0 / y
        xw = x * w[:, None]
        scale = np.linalg.norm(xw, axis=0)
        scale[scale == 0] = 1.0
        coef, _ = nnls(xw / scale, y * w, maxiter=50 * x.shape[1])
        result: np.ndarray = coef / scale
        return result

    return memo_solve("nnls_relative", (x, y), f"{scipy.__version__} {np.__version__}", solve)
