"""A decode run leaves the engine as its single steps do: two engine cores over the same
workload and the same clock, one advanced by decode runs wherever the scheduler offers
one (`EngineCore.decode_run` / `advance_decode`, as the simulator drives them), the other
taking every step on its own (`EngineCore.step`), hold equal state after every run and
every single step (docs/design.md, "Fast-forward"):

- the scheduler's: its queues in order, each request's status, computed and output
  tokens, placeholders, block hashes, times and record, the ids the next step tells the
  executor to drop, and `_cached_ahead` (the blocks each unapplied step cached ahead,
  which a failed step un-caches);
- the KV cache's: each request's block ids, the free blocks in eviction order, the
  cached hashes and where they are, the lower tiers' blocks and slots;
- under async scheduling, the step in flight that a run leaves: its requests' block ids
  and prior-block counts, and the ended and preempted ids it names.

The oracle is the single-step engine: every step through the scheduler's own rules,
which the rest of this suite checks against its mirrors. `test_fast_forward.py` compares
what `simulate` reports; this compares the state behind it, where a run that took its
blocks in another order, or left another step in flight, shows at once.

The workloads are the property driver's (stop tokens, stop strings, EOS, min_tokens,
priorities, prefix caching, small caches that preempt, aborts) on engines with and
without async scheduling and with host and store tiers below HBM; a run is cut where an
arrival or an abort is due, and at random before its horizon. Requests that a token
could end (a stop token, a stop string, EOS) are never in a run: a run ends requests by
length only, inside the run when nothing waits (`through_finishes`). A decode engine's
requests may await their prompt's KV, which arrives some driver steps after their blocks
are reserved (an event that cuts a run, as an arrival does).

Before each run is asked for, the number of steps the rule of docs/design.md makes
certain is restated from the engine's state (`_rule_horizon`: the queues, each request's
tokens and stop conditions, the step in flight, the free blocks counted step by step)
and must equal the scheduler's horizon: a run refused or cut short where the rule allows
it leaves the same state (only fewer steps are skipped), so the lockstep alone would not
see it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.config import EngineConfig, EngineRole
from deepinfer.decode_run import DecodeRun
from deepinfer.engine import EngineCore
from deepinfer.errors import SchedulerStalled
from deepinfer.kv_cache.tiers import HOST, STORE, KVTiers, TierLRU
from deepinfer.request import Request, RequestStatus
from sim.sim_executor import SimExecutor
from tests.property.coverage import TRANSITIONS
from tests.property.harness import DriverClock, make_request
from tests.property.sim_text import TextStops, sim_text
from tests.property.strategies import (
    EngineCase,
    ReqSpec,
    Workload,
    any_case_and_workload,
    either,
    scaled,
    sim_token,
    stop_fields,
)


class _Side:
    """One engine of the pair, its requests and the stop strings ended from outside."""

    def __init__(
        self, case: EngineCase, tiers: tuple[int, int], clock: DriverClock, structured: bool
    ) -> None:
        cfg = case.config
        host, store = tiers
        kv_tiers = None
        if cfg.enable_prefix_caching and (host or store):
            kv_tiers = KVTiers(
                TierLRU(HOST, host) if host else None, TierLRU(STORE, store) if store else None
            )
        self.core = EngineCore(
            cfg, SimExecutor(cfg, cfg.num_gpu_blocks), clock=clock, kv_tiers=kv_tiers
        )
        self.reqs: dict[str, Request] = {}
        self.text = TextStops()
        self.structured = structured

    def add(self, spec: ReqSpec, awaits_kv: bool = False) -> None:
        req = make_request(spec)
        req.awaiting_kv = awaits_kv  # (a decode engine's: its prompt's KV is sent to it)
        # The 3rd, 6th, ... request is structured (the simulator prices its mask), as in
        # the property driver's `Flavours`: a run never takes one.
        req.structured = self.structured and len(self.reqs) % 3 == 2
        self.reqs[spec.req_id] = req
        self.text.track(req)
        self.core.add_request(req)

    def step(self) -> bool:
        """One engine step, stop strings applied after it; False: the engine stalled."""
        try:
            changed = self.core.step()
        except SchedulerStalled:
            return False
        self.text.after_update(self.core, changed)
        return True

    def advance(self, run: DecodeRun, times: list[float]) -> None:
        self.core.advance_decode(run, times, times)
        self.text.after_update(self.core, run.requests)


def _state(side: _Side) -> dict[str, Any]:
    """Everything a later step reads of the engine, by name (block objects by id)."""
    core = side.core
    s = core.scheduler
    kv = s.kv
    pool = kv.pool
    state: dict[str, Any] = {
        "step_id": s.step_id,
        "running": [r.request_id for r in s.running],
        "waiting": [r.request_id for r in s.waiting],
        "live": sorted(s.requests),
        "counts": (s.num_finished, s.num_aborted, s.num_rejected, s.num_preemptions),
        "finished since the last step": sorted(s._finished_since_last),
        "preempted since the last step": sorted(s._preempted_since_last),
        "cached ahead": {
            step: [b.block_id for b in blocks] for step, blocks in s._cached_ahead.items()
        },
        "tables": {rid: [b.block_id for b in t] for rid, t in kv.req_blocks.items()},
        "blocks registered as cached": dict(kv._num_cached),
        "free blocks": pool.num_free_blocks,
        "blank blocks": pool.num_blank_blocks,
        "free cached blocks, eviction order": list(pool._free),
        "cached hashes": {h: b.block_id for h, b in pool._cached.items()},
        "held blocks": [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        "evictions": pool.num_evictions,
        "pending": ([b.block_id for b in kv._cached_ahead], kv._loads_ahead),
        "lookups": (kv.num_lookup_tokens, kv.num_hit_tokens, dict(kv.prefix_hit_blocks)),
        "requests": {rid: _request(r) for rid, r in side.reqs.items()},
        "records": list(core.records),
        "steps": list(core.steps),
        "last step end": core._last_step_end,
    }
    tiers = kv.tiers
    if tiers is not None:
        state["tiers"] = [
            (t.name, [(h, t.slot(h)) for h in t.hashes()], t.num_saved, t.num_loaded)
            for t in tiers.order
        ]
        state["tier counts"] = (dict(tiers.saved), dict(tiers.loaded), tiers.dropped)
        state["saves pending"] = list(tiers._saves)
    flight = core._in_flight
    if flight is not None:
        out = flight.out
        # kv_saves left out: a run's steps copy no block (only the simulator runs them),
        # so the step a run leaves in flight lists none.
        state["in flight"] = (
            out.step_id,
            out.scheduled,
            sorted(out.finished_req_ids),
            sorted(out.preempted_req_ids),
            out.kv_loads,
            out.num_proposals,
            flight.start,
            flight.ended,
        )
    return state


def _request(r: Request) -> tuple[object, ...]:
    t = r.times
    return (
        r.status,
        r.finish_reason,
        r.num_computed_tokens,
        r.max_computed_tokens,
        list(r.output_token_ids),
        r.num_output_placeholders,
        r.num_preemptions,
        r.num_cached_tokens,
        list(r.block_hashes),
        (t.first_scheduled, t.first_token, list(t.token_times), t.finish),
    )


def _rule_horizon(core: EngineCore, through_finishes: bool) -> int | None:
    """The steps from here that docs/design.md's "Fast-forward" rule makes certain, or
    None where it offers no run: restated from the requests, the queues and the free
    blocks (the engine's state, which the lockstep checks against the single steps), one
    step at a time, not from the scheduler's horizon."""
    cfg = core.config
    s = core.scheduler
    flight = core._in_flight
    if cfg.async_scheduling:  # the step in flight must be one of the run's
        if flight is None or flight.ended is not None:
            return None
    elif flight is not None:
        return None
    running = list(s.running)
    n = len(running)
    if (
        not n
        or n > cfg.max_num_batched_tokens  # the token budget holds them all
        or cfg.num_speculative_tokens
        or cfg.role is EngineRole.PREFILL
        or s.emit_token_ids
        or core._compiling
        or core._grammar_rejected
    ):
        return None
    queued = list(s.waiting)
    # A request awaiting its KV is passed over; any other in progress (a chunked
    # prefill between chunks) is scheduled.
    if any(r.status is RequestStatus.PREFILLING and not r.awaiting_kv for r in queued):
        return None
    in_progress = sum(r.status is RequestStatus.PREFILLING for r in queued)
    others = [r for r in queued if r.status is not RequestStatus.PREFILLING]
    may_start = (
        n < cfg.max_num_batched_tokens  # a token of the budget left for a start
        and n + in_progress < cfg.max_num_seqs
        and not (cfg.role is EngineRole.NORMAL and s.kv.usage > cfg.prefill_watermark)
    )
    if others and may_start:
        return None
    placeholders = 1 if cfg.async_scheduling else 0
    if flight is not None:  # the requests it schedules that still live: the running ones
        live = [sr for sr in flight.out.scheduled if sr.req_id in s.requests]
        if [sr.req_id for sr in live] != [r.request_id for r in running]:
            return None
        for sr in live:  # each samples one token: a decode, or a prompt's last chunk
            if not sr.will_sample or sr.draft_token_ids or not (sr.num_tokens == 1 or sr.is_prompt):
                return None
    limits = []
    for r in running:
        sp = r.sampling_params
        if r.structured or sp.stop or sp.stop_token_ids:
            return None
        if not sp.ignore_eos and r.eos_token_id is not None:
            return None  # a token could end it
        known = r.num_prompt_tokens + len(r.output_token_ids)
        if r.num_output_placeholders != placeholders:
            return None
        if known + placeholders != r.num_computed_tokens + 1:
            return None  # not decoding: its known tokens one past its computed ones
        limit = s.max_model_len - known
        if sp.max_tokens is not None:
            limit = min(limit, sp.max_tokens - len(r.output_token_ids))
        limits.append(limit)
    horizon = max(limits) if through_finishes and not queued else min(limits)
    if horizon < 1:
        return None
    # Step j writes each request's position computed + j: a new block at each first slot
    # past the blocks it holds. The step that needs one more block than are free (blank
    # ones only beside a shared store) is not certain.
    pool, bs = s.kv.pool, s.block_size
    free = pool.num_free_blocks
    if s.kv.tiers is not None and s.kv.tiers.store is not None:
        free = pool.num_blank_blocks
    taken = 0
    for j in range(horizon):
        for r, limit in zip(running, limits):
            pos = r.num_computed_tokens + j
            held = len(s.kv.req_blocks[r.request_id]) * bs
            if j < limit and pos >= held and (pos - held) % bs == 0:
                taken += 1
        if taken > free:
            return j if j >= 1 else None
    return horizon


def _assert_same(single: _Side, runs: _Side, where: str) -> None:
    a, b = _state(single), _state(runs)
    for key in a.keys() | b.keys():
        assert b.get(key) == a.get(key), (
            f"{where}: {key} differs\n single steps: {a.get(key)!r}\n runs:         {b.get(key)!r}"
        )


class Lockstep:
    """Drives the pair: arrivals and aborts at driver steps, then either a run on one
    side and as many single steps on the other, or one single step on both."""

    def __init__(
        self,
        case: EngineCase,
        workload: Workload,
        tiers: tuple[int, int],
        through_finishes: bool,
        structured: bool,
        kv_delays: dict[str, int] | None = None,
    ) -> None:
        self.clock = DriverClock()
        self.single = _Side(case, tiers, self.clock, structured)
        self.runs = _Side(case, tiers, self.clock, structured)
        self.workload = workload
        self.through_finishes = through_finishes
        # Requests that await their prompt's KV: it arrives this many driver steps after
        # their blocks are reserved (an event, as an arrival: it cuts a run).
        self.kv_delays = kv_delays or {}
        self.kv_due: dict[str, int] = {}
        self.num_runs = 0
        self.longest = 0  # steps of the longest run
        self.ended_inside = 0  # requests a run ended before its last step
        self.ended_before_last = 0  # ... in the turn before it, under async scheduling
        self.asked = 0  # decode runs asked for with requests running and a step in flight
        self.two_after_end = 0  # async runs of two steps right after a request ended
        self._ended: set[str] = set()  # the workload's requests ended, as of the last step
        # runs whose batch is the whole token budget: alone, beside a waiting request
        self.full_budget = [0, 0]

    def run(self, cut: st.DataObject | None) -> Lockstep:
        arrivals = sorted(self.workload, key=lambda s: s.arrival_step)
        aborts = sorted(
            (s for s in self.workload if s.abort_step is not None),
            key=lambda s: s.abort_step,  # type: ignore[arg-type,return-value]
        )
        t = 0
        sides = (self.single, self.runs)
        while True:
            while arrivals and arrivals[0].arrival_step <= t:
                spec = arrivals.pop(0)
                self.clock.now = float(t)
                for side in sides:
                    side.add(spec, spec.req_id in self.kv_delays)
            while aborts and aborts[0].abort_step <= t:  # type: ignore[operator]
                rid = aborts.pop(0).req_id
                for side in sides:
                    side.core.abort(rid)
            self._kv_arrivals(t)
            events = [s.arrival_step for s in arrivals] + [s.abort_step for s in aborts]
            events += self.kv_due.values()
            if not self.single.core.has_unfinished():
                assert not self.runs.core.has_unfinished(), f"step {t}: the runs' engine has work"
                if not arrivals:
                    return self
                t = arrivals[0].arrival_step
                continue
            self.clock.now = float(t)
            ended = {rid for rid, r in self.single.reqs.items() if r.is_finished}
            just_ended, self._ended = bool(ended - self._ended), ended
            rule = _rule_horizon(self.runs.core, self.through_finishes)
            self.asked += bool(self.runs.core.scheduler.running and self.runs.core._in_flight)
            run = self.runs.core.decode_run(self.through_finishes)
            assert (run and run.horizon) == rule, (
                f"step {t}: the rule makes {rule} steps certain, the scheduler offers {run}"
            )
            if run is None:
                stepped = [side.step() for side in sides]
                assert stepped[0] == stepped[1], f"step {t}: one engine stalled, not the other"
                _assert_same(self.single, self.runs, f"after the single step at {t}")
                if not stepped[0]:  # nothing moves until an arrival or an abort
                    if not events:
                        return self
                    t = min(events)  # type: ignore[type-var]
                    continue
                t += 1
                continue
            k = run.horizon
            if events:
                k = min(k, min(events) - t)  # type: ignore[type-var, operator]
            if cut is not None and k > 1 and cut.draw(st.booleans(), label="cut the run"):
                k = cut.draw(st.integers(1, k - 1), label="steps taken")
            times = [float(t + s) for s in range(k)]
            for s in range(k):
                self.clock.now = times[s]
                assert self.single.step(), f"step {t + s}: a certain step of a run stalled"
            self.runs.advance(run, times)
            self.clock.now = times[-1]
            self._count(run, k, just_ended)
            _assert_same(self.single, self.runs, f"after a run of {k} steps from {t}: {run}")
            t += k

    def _kv_arrivals(self, t: int) -> None:
        """The KV of each request reserved since the last step is due its delay from
        now; the KVs due by `t` arrive (on both engines)."""
        reserved = [rid for rid, _ in self.single.core.take_kv_reserved()]
        assert [rid for rid, _ in self.runs.core.take_kv_reserved()] == reserved, t
        for rid in reserved:
            self.kv_due[rid] = t + self.kv_delays[rid]
        for rid, due in list(self.kv_due.items()):
            if due <= t:
                del self.kv_due[rid]
                for side in (self.single, self.runs):
                    if rid in side.core.scheduler.requests:  # (not aborted meanwhile)
                        side.core.kv_arrived(rid)

    def _count(self, run: DecodeRun, k: int, just_ended: bool) -> None:
        self.num_runs += 1
        core = self.runs.core
        if k == 2 and run.in_flight_step is not None and just_ended:
            self.two_after_end += 1
        if run.num_reqs == core.config.max_num_batched_tokens:
            self.full_budget[bool(core.scheduler.waiting)] += 1
        self.longest = max(self.longest, k)
        ended = sum(1 for h in run.limits if h < k)
        self.ended_inside += ended
        c = TRANSITIONS.counts
        if k > 1:
            c["decode run of several steps"] += 1
            if run.in_flight_step is not None:
                c["decode run of several steps under async scheduling"] += 1
        if ended:
            c["request ended inside a decode run"] += ended
        if run.in_flight_step is not None and any(h == k - 1 for h in run.limits):
            # its end is named by the step the run leaves in flight
            self.ended_before_last += 1
            c["request ended in the turn before an async run's last step"] += 1
        if self.runs.core.scheduler.num_awaiting_kv:
            c["decode run beside a request awaiting its KV"] += 1


def _stops_kept(workload: Workload, keep: str) -> Workload:
    """The workload with its requests' stop conditions kept ("all"), kept on the first
    request that has any ("one": the others leave room for runs beside it), or dropped
    ("none": the lengths end every request)."""
    if keep == "all":
        return workload
    plain = {"min_tokens": 0, "stop_token_ids": (), "eos_token_id": None, "ignore_eos": True}
    out, kept = [], keep == "none"
    for spec in workload:
        has = spec.stop_token_ids or spec.stop or not spec.ignore_eos
        if has and not kept:
            kept = True
            out.append(spec)
        else:
            out.append(replace(spec, stop=(), **plain))
    return tuple(out)


_DRIVER_CASES = (
    any_case_and_workload(allow_spec=False, aborts=False),
    any_case_and_workload(allow_spec=False),
)


_SOME = st.sampled_from([False, False, False, True])


@st.composite
def _decoding_together(draw: st.DrawFn) -> tuple[EngineCase, Workload]:
    """2 to 6 requests at once, short prompts sharing a prefix, outputs of 1 to 40 tokens,
    in a cache that holds them all or a few blocks short of it (a run then ends where
    its blocks run out, or a request is preempted): after the prompts they decode
    together and end one by one, the runs' own case."""
    bs = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    n = draw(st.integers(2, 6))
    shared = tuple(range(1, 2 * bs + 2))
    specs = []
    for i in range(n):
        head = shared[: draw(st.integers(0, len(shared)))]
        prompt = head + (1000 + i,) * draw(st.integers(1 if not head else 0, 2 * bs))
        max_tokens, priority = draw(st.integers(1, 40)), draw(st.integers(0, 3))
        # Now and then a request a token could end (a stop token, EOS, a stop string
        # placed where its tokens make them): no run may take it in.
        stops = stop_fields(draw, f"r{i}", len(prompt), max_tokens) if draw(_SOME) else {}
        specs.append(ReqSpec(f"r{i}", 0, prompt, max_tokens, priority, **stops))
    need = sum(-(-(len(sp.prompt) + sp.max_tokens) // bs) for sp in specs)
    chunked = draw(st.booleans())
    cfg = EngineConfig(
        block_size=bs,
        num_gpu_blocks=max(need + draw(st.integers(-3, 4)), -(-(4 * bs + 41) // bs)),
        max_num_seqs=draw(st.integers(n, 8)),
        # n - 1: a step decodes all but one of them (no run); n: exactly all of them
        max_num_batched_tokens=draw(st.sampled_from([n - 1, n, 4 * bs + 41, 512]))
        if chunked
        else 512,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        async_scheduling=draw(st.sampled_from([True, True, False])),
        # (a prefill engine: never a run, its requests end at their first token)
        role=draw(st.sampled_from([EngineRole.NORMAL, EngineRole.DECODE, EngineRole.PREFILL])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
    )
    return EngineCase(cfg, 0.7), tuple(specs)


@st.composite
def _one_stops_inside(draw: st.DrawFn) -> tuple[EngineCase, Workload]:
    """Requests decoding together beside one that a token ends at a drawn output, inside
    the others' run: by a stop string alone, by EOS it does not ignore, or by a stop
    token. A run that took it in would end it by length only, past that output."""
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    n = draw(st.integers(1, 4))
    # EOS ignored, or none to end on: neither keeps a request out of a run.
    eos = st.sampled_from([{}, {"eos_token_id": 0}, {"ignore_eos": False}])
    specs = [
        ReqSpec(f"r{i}", 0, (1000 + i,) * draw(st.integers(1, 2 * bs)), 40, **draw(eos))
        for i in range(n)
    ]
    rid, prompt = "s", (7,) * draw(st.integers(1, 2 * bs))
    at = draw(st.integers(1, 30))  # the output index whose token ends it
    token = sim_token(rid, len(prompt) + at)
    kind = draw(st.sampled_from(["stop string", "eos", "stop token"]))
    fields: dict[str, Any] = {
        "stop string": {"stop": (sim_text(token),)},
        "eos": {"eos_token_id": token, "ignore_eos": False},
        "stop token": {"stop_token_ids": (token,)},
    }[kind]
    specs.insert(draw(st.integers(0, n)), ReqSpec(rid, 0, prompt, 40, **fields))
    cfg = EngineConfig(
        block_size=bs,
        num_gpu_blocks=-(-(n + 1) * (2 * bs + 41) // bs) + 1,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        enable_chunked_prefill=True,
        enable_prefix_caching=draw(st.booleans()),
        async_scheduling=draw(st.booleans()),
        role=EngineRole.NORMAL,
        policy="fcfs",
    )
    return EngineCase(cfg, 0.7), tuple(specs)


@st.composite
def _cases_and_workloads(draw: st.DrawFn) -> tuple[EngineCase, Workload]:
    """The property driver's engines and workloads without speculation (no run is
    certain under it), half without aborts (each cuts a run), or requests that decode
    together (a third of the examples)."""
    return either(draw, *_DRIVER_CASES, _decoding_together())  # type: ignore[return-value]


@scaled(0.6, floor=80)
@given(
    _cases_and_workloads(),
    st.sampled_from(["one", "none", "one", "none", "all"]),
    st.tuples(st.sampled_from([0, 0, 1, 3, 20]), st.sampled_from([0, 0, 2, 20])),
    st.sampled_from([True, True, False]),
    st.booleans(),
    st.data(),
)
def test_a_decode_run_leaves_the_state_its_single_steps_leave(
    case_and_workload: tuple[EngineCase, Workload],
    stops: str,
    tiers: tuple[int, int],
    through_finishes: bool,
    structured: bool,
    cut: st.DataObject,
) -> None:
    case, workload = case_and_workload
    kv_delays = {}
    if case.config.role is EngineRole.DECODE:  # some await their prompt's KV
        for spec in workload:
            delay = cut.draw(st.sampled_from([None, None, 0, 1, 4]), label="KV arrives after")
            if delay is not None:
                kv_delays[spec.req_id] = delay
    workload = _stops_kept(workload, stops)
    Lockstep(case, workload, tiers, through_finishes, structured, kv_delays).run(cut)


@scaled(0.1, floor=20)
@given(_one_stops_inside(), st.booleans())
def test_a_request_a_token_ends_is_never_in_a_run(
    case_and_workload: tuple[EngineCase, Workload], through_finishes: bool
) -> None:
    case, workload = case_and_workload
    pair = Lockstep(case, workload, (0, 0), through_finishes, False).run(None)
    # The state it was written for: the others ran while the one stopped ("s" ended
    # before its max_tokens, by its token).
    stopped = pair.single.reqs["s"]
    assert len(stopped.output_token_ids) < 40 and pair.num_runs >= 1, (
        stopped.output_token_ids,
        pair.num_runs,
    )


def _steady(async_scheduling: bool, tiers: tuple[int, int]) -> tuple[EngineCase, Workload]:
    """Four requests at once, no stop condition but their lengths, in a cache that holds
    them all: after the prompts, decode runs; with nothing waiting one run goes on past
    each finish (outputs 5, 9, 13, 17 tokens over 3-token blocks)."""
    cfg = EngineConfig(
        block_size=3,
        num_gpu_blocks=40,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        async_scheduling=async_scheduling,
        role=EngineRole.NORMAL,
        policy="fcfs",
    )
    shared = tuple(range(1, 7))
    workload = tuple(
        ReqSpec(f"r{i}", 0, shared + (100 + i,) * (i + 1), 5 + 4 * i) for i in range(4)
    )
    return EngineCase(cfg, 0.7), workload


def test_a_run_past_finishes_leaves_the_state_of_its_single_steps() -> None:
    """The pinned case the random one must also reach: a run of several steps in which
    requests end by length (before its last step), with and without async scheduling,
    over a host tier and without."""
    for async_scheduling in (False, True):
        for tiers in ((0, 0), (3, 2)):
            case, workload = _steady(async_scheduling, tiers)
            pair = Lockstep(case, workload, tiers, True, False).run(None)
            # The state it was written for: one run to the last finish, three ended inside.
            assert pair.num_runs >= 1 and pair.longest >= 12, (pair.num_runs, pair.longest)
            assert pair.ended_inside == 3, pair.ended_inside


def test_an_end_in_the_turn_before_an_async_runs_last_step_is_named_by_the_step_in_flight() -> None:
    """The pinned case of a request that ends in the turn before a run's last step under
    async scheduling: the step the run leaves in flight was scheduled after that turn,
    so it tells the executor to drop the request (outputs 5, 6, 8, 9: r0 ends one step
    before r1, r2 one before r3, the run's last)."""
    case, workload = _steady(True, (0, 0))
    workload = tuple(replace(s, max_tokens=m) for s, m in zip(workload, (5, 6, 8, 9)))
    pair = Lockstep(case, workload, (0, 0), True, False).run(None)
    # The state it was written for: one run to the last finish, r2 ending in the turn
    # before its last step.
    assert pair.num_runs == 1 and pair.ended_before_last == 1, (
        pair.num_runs,
        pair.ended_before_last,
    )


def test_an_async_run_of_two_steps_leaves_in_flight_a_step_that_drops_nobody() -> None:
    """The pinned case of a two-step run under async scheduling right after a finish
    (runs end at each finish: outputs 5, 7, 9, 11): its first step tells the executor
    to drop the ended request, the step it leaves in flight names no one."""
    case, workload = _steady(True, (0, 0))
    workload = tuple(replace(s, max_tokens=m) for s, m in zip(workload, (5, 7, 9, 11)))
    pair = Lockstep(case, workload, (0, 0), False, False).run(None)
    # The state it was written for: such runs (after r0's end, r1's and r2's).
    assert pair.two_after_end >= 1, pair.two_after_end


def test_a_prefill_engine_runs_single_steps() -> None:
    """The pinned case of a prefill engine under async scheduling, its prompts chunked
    (a 4-token budget): the step in flight samples a running request's first token,
    after which it hands the request over (ends it), so no run is certain
    (docs/design.md: a prefill engine runs single steps)."""
    case, workload = _steady(True, (0, 0))
    cfg = replace(case.config, role=EngineRole.PREFILL, max_num_batched_tokens=4)
    pair = Lockstep(EngineCase(cfg, 0.7), workload, (0, 0), True, False).run(None)
    # The state it was written for: asked with requests running and a step in flight.
    assert pair.asked >= 1 and pair.num_runs == 0, (pair.asked, pair.num_runs)


def test_a_batch_of_the_whole_token_budget_runs_beside_a_waiting_request() -> None:
    """The pinned case of a batch exactly the token budget: with a fifth request waiting
    (no token left to start it, so a run is certain) and after it, alone (the budget
    holds every request of the run)."""
    for async_scheduling in (False, True):
        case, workload = _steady(async_scheduling, (0, 0))
        case = EngineCase(replace(case.config, max_num_batched_tokens=4), 0.7)
        workload = tuple(replace(s, max_tokens=20 + 4 * i) for i, s in enumerate(workload))
        workload += (ReqSpec("r4", 14, (1, 2, 3), 9),)  # once the others decode
        pair = Lockstep(case, workload, (0, 0), True, False).run(None)
        # The state it was written for: runs of four, alone and beside r4 waiting.
        assert min(pair.full_budget) >= 1, pair.full_budget


def test_a_run_is_advanced_no_further_than_its_horizon() -> None:
    """`advance_decode` takes 1 to `run.horizon` steps: more is refused, naming both."""
    case, workload = _steady(False, (0, 0))
    side = _Side(case, (0, 0), DriverClock(), False)
    for spec in workload:
        side.add(spec)
    side.step()
    run = side.core.scheduler.decode_run(None)
    assert run is not None and run.horizon == 4  # r0's 4 more tokens: the state it was written for
    for k in (0, run.horizon + 1):
        with pytest.raises(ValueError, match=f"advance_decode: {k} steps of a run certain for 4"):
            side.core.scheduler.advance_decode(run, k, [[1] * k] * run.num_reqs)
