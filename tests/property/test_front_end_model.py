"""The data-parallel front-end and its ranks' loop (deepinfer/data_parallel/front_end.py,
rank_loop.py) against a model of docs/design.md, "Data parallelism", as a hypothesis
state machine.

Each rank is the production loop, `rank_loop.serve`, on a thread of this process behind
a connection that pickles both ways and refuses what does not pickle before sending
anything (as multiprocessing's Pipe does); its EngineCore runs the scripted executor
(the token at position p is 1000 + p). The machine adds requests (some too long for a
rank, some for every rank), steps, interrupts a step while it reads a reply (Ctrl-C),
makes a rank's step raise (an error that pickles or one that does not), ends requests
from the front-end (finish, abort, ids it does not hold) and shuts down (some ranks
gone). The model keeps its own log and checks, from it and from what each rank sent:
- placement: the router's rule restated (test_router_model.RouterModel), fed the
  reports the ranks put on the wire and the model's own placements and ends;
- lock-step: every rank runs one round per step, also with nothing to run: round_begin,
  its engine's step only when it holds work, round_end, then its one reply;
- the wire: each reply is its rank's state after the round (the scheduler's waiting,
  running and KV usage), carries its error's traceback only when the step raised;
  the front-end's view of a rank is that report, its prefix-cache picture what the
  rank's pool holds;
- the requests: each rank holds exactly the live requests placed on it; the
  front-end's copy of each equals the rank's after every step; `step` returns each
  request a received delta changed, in the order the deltas came; a request ends
  once, as the spec says (rejected when no rank admits it, else its max_tokens or the
  rank's max_model_len, or the front-end's reason and clock), and its copy never
  changes after;
- a rank's error is `RankFailed` after every rank answered, naming the lowest failing
  rank, its error and its traceback; the next step finds nothing owed.
"""

from __future__ import annotations

import pickle
import queue
import sys
import threading
import time
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deepinfer.data_parallel.front_end import DataParallelEngine, RankFailed
from deepinfer.data_parallel.protocol import RankInfo, StepReply, Stop
from deepinfer.data_parallel.rank_loop import serve
from deepinfer.engine import EngineCore
from deepinfer.kv_cache.hashing import update_block_hashes
from deepinfer.request import FinishReason, Request, RequestStatus
from deepinfer.routing import ROUTERS, InstanceLoad, make_router
from deepinfer.routing.instance_report import InstanceReport, take_report
from deepinfer.routing.instance_view import views_of
from deepinfer.routing.policies import SEEDED
from deepinfer.sampling_params import SamplingParams
from tests.factories import make_engine, rank_info
from tests.property.harness import note
from tests.property.strategies import at_least
from tests.property.test_request_sync_model import fields
from tests.property.test_router_model import BS, RouterModel

WAIT_S = 10.0  # a reply later than this is a hang (a round here takes milliseconds)
HUGE = 50  # prompt tokens no rank admits (12 blocks of 4 tokens hold 47 and one output)
IMBALANCE = 8  # prefix-affinity's default max_imbalance (the front-end passes no options)


class UnpicklableError(Exception):
    """A step's error that cannot cross a pipe: it holds a lock."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class Clock:
    """The front-end's clock: distinct readings, each kept."""

    def __init__(self) -> None:
        self.readings: list[float] = []

    def __call__(self) -> float:
        self.readings.append(1000.0 + 0.5 * len(self.readings))
        return self.readings[-1]


class ThreadRank:
    """One rank: `rank_loop.serve` over an EngineCore on a thread. This object is the
    front-end's end of its connection (a RankClient); `log` is the rank's side of its
    rounds, in order; `wire` (shared by the ranks) gets each reply the front-end reads,
    with the rank it came from."""

    def __init__(self, index: int, engine: EngineCore, wire: list[tuple[int, StepReply]]) -> None:
        self.index, self.engine, self.wire = index, engine, wire
        self.commands: queue.Queue[bytes] = queue.Queue()
        self.replies: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.log: list[Any] = []
        self.sent = 0  # commands sent (Stop included)
        self.answered = 0  # replies put on the pipe
        self.interrupt = False  # the front-end's next recv raises KeyboardInterrupt
        self.fail: BaseException | None = None  # the engine's next step raises this
        self.gone: type[OSError] | None = None  # sending raises this (the rank died)
        self._engine_step = engine.step
        engine.step = self._step  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"rank {index}")
        self.thread.start()

    # ---- the front-end's end -------------------------------------------------------
    def send(self, obj: Any) -> None:
        if self.gone is not None:
            raise self.gone(f"rank {self.index} is gone")
        self.commands.put(pickle.dumps(obj))
        self.sent += 1

    def recv(self) -> Any:
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        try:
            kind, payload = self.replies.get(timeout=WAIT_S)
        except queue.Empty:
            raise AssertionError(f"rank {self.index} never answered") from None
        assert kind == "reply", f"rank {self.index}'s loop {kind} instead of answering: {payload}"
        reply = pickle.loads(payload)
        self.wire.append((self.index, reply))
        return reply

    def settle(self) -> None:
        """Wait until the rank has answered every command sent (a step interrupted on
        the front-end leaves the ranks running their round)."""
        deadline = time.monotonic() + WAIT_S
        while self.answered < self.sent:
            assert time.monotonic() < deadline, f"rank {self.index} never answered"
            time.sleep(0.0002)

    def close(self) -> None:
        """End the loop directly (a run that failed before its shutdown)."""
        self.commands.put(pickle.dumps(Stop()))
        self.thread.join(WAIT_S)

    # ---- the rank's end --------------------------------------------------------------
    def _run(self) -> None:
        try:
            serve(self.index, self.engine, _RankEnd(self), self._begin, self._end)
        except BaseException as exc:  # the loop died: the front-end's recv says so
            self.replies.put(("raised", repr(exc)))
        else:
            self.log.append("stopped")
            self.replies.put(("returned", None))

    def _begin(self) -> None:
        self.log.append(("begin", self.engine.has_unfinished()))

    def _end(self) -> None:
        self.log.append("end")

    def _step(self) -> list[Request]:
        self.log.append("step")
        if self.fail is not None:
            raise self.fail
        return self._engine_step()


class _RankEnd:
    """The rank's end of a ThreadRank's connection."""

    def __init__(self, rank: ThreadRank) -> None:
        self.rank = rank

    def send(self, obj: Any) -> None:
        data = pickle.dumps(obj)  # raises on what does not pickle, sending nothing
        self.rank.log.append("reply")
        self.rank.replies.put(("reply", data))
        self.rank.answered += 1

    def recv(self) -> Any:
        return pickle.loads(self.rank.commands.get(timeout=10 * WAIT_S))


def _prompt(run: tuple[int, int], tail: int, huge: bool) -> tuple[int, ...]:
    """Whole blocks of shared chunks (a run of consecutive ones from one of two
    starts), then `tail` tokens; token ids stay below the outputs' (1000 + position)."""
    start, blocks = run
    out = [(start + b) % 4 * 100 + j + 1 for b in range(blocks) for j in range(BS)]
    out += [500 + j for j in range(HUGE if huge else tail)]
    return tuple(out) or (1,)


def _outputs(f: dict[str, object]) -> tuple[object, ...]:
    """What a request has produced, of its `fields`."""
    times = f["times"]
    assert isinstance(times, tuple)
    return f["output_token_ids"], f["logprobs"], times[1], times[3]


class FrontEndMachine(RuleBasedStateMachine):
    """Arrivals, steps (plain, interrupted, failing), front-end ends and a shutdown
    over 1-3 threaded ranks of small, uneven caches."""

    @initialize(
        n=st.sampled_from([1, 2, 3, 3, 3]),
        blocks=st.lists(st.integers(3, 12), min_size=3, max_size=3),
        seqs=st.integers(1, 3),
        # power-of-two's seed shows only with three ranks to draw from, and seed 0 is
        # the front-end's default: both are drawn often
        policy=st.sampled_from([*sorted(ROUTERS), *[SEEDED[0]] * 2]),
        seed=st.sampled_from([0, 0, 1, 2]),
        explicit=st.booleans(),
        gone=st.lists(st.integers(0, 4), min_size=3, max_size=3),
        hook=st.booleans(),
    )
    def setup(
        self,
        n: int,
        blocks: list[int],
        seqs: int,
        policy: str,
        seed: int,
        explicit: bool,
        gone: list[int],
        hook: bool,
    ) -> None:
        blocks = blocks[:n]
        self.wire: list[tuple[int, StepReply]] = []
        self.ranks = [
            ThreadRank(r, make_engine(num_gpu_blocks=b, max_num_seqs=seqs), self.wire)
            for r, b in enumerate(blocks)
        ]
        infos = [rank_info(r.index, r.engine) for r in self.ranks]
        self.clock = Clock()
        options: dict[str, Any] = {}
        if explicit or policy != "least-load":  # else the default router
            options["router"] = policy
        if explicit or seed:  # else the default seed
            options["seed"] = seed
        self.dp = DataParallelEngine(self.ranks, infos, clock=self.clock, **options)
        assert self.dp.num_ranks == n
        assert self.dp.max_model_len == min(r.engine.max_model_len for r in self.ranks)
        self.limits = [r.engine.scheduler.max_prompt_tokens for r in self.ranks]
        self.placement = RouterModel(policy, self.limits, IMBALANCE)
        self.twin = make_router(policy, n, seed=seed) if policy in SEEDED else None
        self.twin_views = views_of(BS, self.limits)
        self.gone = [(BrokenPipeError, OSError)[g] if g < 2 else None for g in gone[:n]]
        self.hook = hook
        # the model's own log
        self.reqs: dict[str, Request] = {}  # every request added, by id
        self.max_tokens: dict[str, int] = {}
        self.placed: dict[str, int] = {}  # request -> the rank it was placed on
        self.live: set[str] = set()  # not ended as far as the front-end has heard
        self.unsent: set[str] = set()  # placed since the last round was sent
        self.ended_here: dict[str, dict[str, object]] = {}  # front-end ends: frozen copy
        self.ended_on_rank: dict[str, dict[str, object]] = {}
        self.to_check: dict[str, tuple[FinishReason, bool]] = {}  # front-end ends to see
        self.rank_ended_first: set[str] = set()  # ended on its rank before the front-end did
        self.known: dict[int, tuple[int, ...]] = {}  # content hash -> its tokens
        self.calls = 0  # step calls since the last completed one
        self.completed = 0  # step calls that read every reply
        self.seen_log = [0] * n
        self.seen_wire = 0
        self.owed = False  # an interrupted step left replies unread
        self.snapshot: dict[str, dict[str, object]] = {}  # copies at the last step's end
        self.count = 0

    # ---- requests ----------------------------------------------------------------------
    @rule(
        run=st.tuples(st.integers(0, 1), st.integers(0, 4)),
        tail=st.integers(0, 6),
        huge=st.integers(0, 9).map(lambda x: x == 0),
        max_tokens=st.integers(1, 6),
        burst=st.integers(1, 3),
    )
    def arrive(
        self, run: tuple[int, int], tail: int, huge: bool, max_tokens: int, burst: int
    ) -> None:
        tokens = _prompt(run, tail, huge)
        for _ in range(burst):
            rid = f"r{self.count}"
            self.count += 1
            req = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            self._learn_hashes(rid, tokens, max_tokens)
            assert self.dp.add_request(req) is None
            chosen = self.dp.rank_of[rid]
            self.placement.placed(rid, tokens, chosen)
            if self.twin is not None:
                twin_req = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))
                again = self.twin.route(twin_req, self.twin_views)
                assert again == chosen, f"same seed, same calls: {again} != {chosen} for {rid}"
            if self.ended_on_rank and len(self.ranks) > 1:
                note("placed among ranks after a request ended on its rank")
            if len(tokens) > self.limits[chosen]:
                note("a request no rank admits")
            elif len(tokens) > min(self.limits):
                note("a request too long for some rank")
            self.reqs[rid], self.max_tokens[rid], self.placed[rid] = req, max_tokens, chosen
            self.live.add(rid)
            self.unsent.add(rid)
            self.snapshot[rid] = fields(req)

    def _learn_hashes(self, rid: str, prompt: tuple[int, ...], max_tokens: int) -> None:
        """The content hash of every whole block the request may ever hold."""
        full = Request(rid, list(prompt))
        outputs = [1000 + len(prompt) + i for i in range(max_tokens)]
        full.output_token_ids.extend(outputs)
        tokens = prompt + tuple(outputs)
        for b, h in enumerate(update_block_hashes(full, BS)):
            self.known[h] = tokens[: (b + 1) * BS]

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 50), how=st.sampled_from(["stop", "abort", "abort()"]))
    def finish(self, pick: int, how: str) -> None:
        self._finish(sorted(self.live)[pick % len(self.live)], how)

    def _finish(self, rid: str, how: str) -> None:
        """The client ends a live request (sent to its rank or not yet)."""
        req, rank = self.reqs[rid], self.placed[rid]
        reason = FinishReason.STOP if how == "stop" else FinishReason.ABORT
        reads = len(self.clock.readings)
        got = self.dp.abort(rid) if how == "abort()" else self.dp.finish(rid, reason)
        assert got is req, f"finish({rid!r}) returned {got!r}"
        status = RequestStatus.FINISHED if how == "stop" else RequestStatus.ABORTED
        assert (req.status, req.finish_reason) == (status, reason), f"{rid} ended {req!r}"
        assert len(self.clock.readings) == reads + 1, "the front-end's clock read once"
        assert req.times.finish == self.clock.readings[-1], "finished at the front-end's clock"
        self.live.discard(rid)
        self.placement.live[rank].discard(rid)
        if self.twin is not None:
            self.twin.on_finished(rid, rank)
        self.ended_here[rid] = fields(req)
        self.snapshot[rid] = fields(req)
        self.to_check[rid] = (reason, rid not in self.unsent)
        if rid in self.unsent:
            note("ended at the front-end before it was sent")
        self.unsent.discard(rid)

    @rule(pick=st.integers(0, 50), how=st.sampled_from(["stop", "abort()"]))
    def finish_unknown(self, pick: int, how: str) -> None:
        """An id the front-end does not hold (ended, or never added): nothing happens."""
        ended = sorted(set(self.reqs) - self.live)
        rid = ended[pick % len(ended)] if ended and pick % 3 else f"nobody{pick}"
        reads = len(self.clock.readings)
        got = self.dp.abort(rid) if how == "abort()" else self.dp.finish(rid, FinishReason.STOP)
        assert got is None, f"finish({rid!r}) of no live request returned {got!r}"
        assert len(self.clock.readings) == reads

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 50))
    def add_again(self, pick: int) -> None:
        """A live id added again is refused by name, and places nothing."""
        rid = sorted(self.live)[pick % len(self.live)]
        try:
            self.dp.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=1)))
        except ValueError as e:
            assert repr(rid) in str(e), str(e)
        else:
            raise AssertionError(f"{rid!r} added twice")
        assert self.dp.requests[rid] is self.reqs[rid]

    # ---- steps ---------------------------------------------------------------------------
    @rule()
    def step(self) -> None:
        changed = self._call_step()
        self._after_round()
        self._check_changed(changed)

    @precondition(lambda self: not self.owed)
    @rule(at=st.integers(0, 2), ends=st.lists(st.integers(0, 50), max_size=2))
    def step_interrupted(self, at: int, ends: list[int]) -> None:
        """Ctrl-C while reading rank `at`'s reply; then the client may end requests
        (whose deltas may wait among the unread replies)."""
        self.ranks[at % len(self.ranks)].interrupt = True
        try:
            self._call_step()
        except KeyboardInterrupt:
            for rank in self.ranks:
                rank.settle()
            self.owed = True
            note("a step interrupted while reading its replies")
        else:
            raise AssertionError("the interruption was swallowed")
        for e in ends:
            if self.live:
                self._finish(sorted(self.live)[e % len(self.live)], "abort")

    @rule(
        which=st.lists(st.integers(0, 2), min_size=1, max_size=2),
        unpicklable=st.booleans(),
    )
    def step_failing(self, which: list[int], unpicklable: bool) -> None:
        """The engine step of some ranks raises (if they run one this round)."""
        n = len(self.ranks)
        targets = sorted({w % n for w in which})
        kind = UnpicklableError if unpicklable else ValueError
        for r in targets:
            self.ranks[r].fail = kind(f"rank {r}'s step broke")
        raised: RankFailed | None = None
        changed: list[Request] | None = None
        try:
            changed = self._call_step()
        except RankFailed as e:
            raised = e
        finally:
            for r in targets:
                self.ranks[r].fail = None
        stepped = self._after_round()
        failing = [r for r in targets if stepped[r][-1]]
        if not failing:
            assert raised is None, f"no rank's step raised, yet {raised!r}"
            self._check_changed(changed)
            return
        assert raised is not None, f"ranks {failing} raised in their step: no RankFailed"
        note(f"RankFailed ({'un' if unpicklable else ''}picklable error)")
        r, text = failing[0], f"rank {failing[0]}'s step broke"
        name = "ValueError"
        if unpicklable:  # sent as its text
            name, text = "RuntimeError", f"UnpicklableError: {text}"
        head, _, trace = str(raised).partition("\n")
        assert head == f"data-parallel rank {r}: {name}: {text}", str(raised)
        assert trace.startswith("Traceback (most recent call last):"), str(raised)
        assert f"Error: rank {r}'s step broke" in trace, str(raised)
        cause = raised.__cause__
        assert type(cause).__name__ == name and str(cause) == text, repr(cause)
        self.snapshot = {rid: fields(req) for rid, req in self.reqs.items()}

    def _call_step(self) -> list[Request]:
        self.calls += 1
        self.unsent.clear()  # every step sends its commands (nothing failed unread)
        return self.dp.step()

    def _after_round(self) -> list[list[bool]]:
        """Checks after a step call that read every reply; returns, per rank, whether it
        stepped its engine in each round since the last such call."""
        self.completed += 1
        rounds, self.calls = self.calls, 0
        self.owed = False
        stepped = [self._rounds_of(r, rounds) for r in range(len(self.ranks))]
        self.expected_changed: list[str] = []
        for rank, reply in self.wire[self.seen_wire :]:
            self._take_reply(rank, reply)
        last = {rank: reply for rank, reply in self.wire[self.seen_wire :]}
        self.seen_wire = len(self.wire)
        for r, rank in enumerate(self.ranks):
            self._check_rank(r, rank, last[r])
        for rid, (reason, sent) in list(self.to_check.items()):
            self._check_end_here(rid, reason, sent)
            del self.to_check[rid]
        for rid, frozen in self.ended_here.items():
            assert fields(self.reqs[rid]) == frozen, f"{rid} changed after the front-end ended it"
        for rid, frozen in self.ended_on_rank.items():
            assert fields(self.reqs[rid]) == frozen, f"{rid} changed after its rank ended it"
        return stepped

    def _rounds_of(self, r: int, rounds: int) -> list[bool]:
        """Rank r's rounds since the last check (lock-step: one per step call): each is
        round_begin, the engine's step exactly when the rank holds work, round_end, then
        its one reply."""
        log = self.ranks[r].log[self.seen_log[r] :]
        self.seen_log[r] = len(self.ranks[r].log)
        stepped, i = [], 0
        while i < len(log):
            head = log[i]
            assert isinstance(head, tuple) and head[0] == "begin", f"rank {r}'s round: {log}"
            body = ["step", "end", "reply"] if head[1] else ["end", "reply"]
            assert log[i + 1 : i + 1 + len(body)] == body, (
                f"rank {r}'s round went {log[i:]}; want begin, {', '.join(body)}"
            )
            if not head[1]:
                note("a rank ran a round with nothing to run")
            stepped.append(head[1])
            i += 1 + len(body)
        assert len(stepped) == rounds, (
            f"rank {r} ran {len(stepped)} rounds in {rounds} steps: {self.ranks[r].log}"
        )
        return stepped

    def _take_reply(self, rank: int, reply: StepReply) -> None:
        """The model applies one received reply, as the spec says the front-end does."""
        assert reply.rank == rank, f"rank {rank}'s reply says rank {reply.rank}"
        assert (reply.error is None) == (reply.error_text == ""), (
            f"rank {rank}: error {reply.error!r} with text {reply.error_text!r}"
        )
        ended = []
        for d in reply.deltas:
            if d.req_id not in self.live:  # ended at the front-end meanwhile
                note("a delta for a request the front-end ended meanwhile")
                if d.status.is_terminal:
                    self.rank_ended_first.add(d.req_id)
                continue
            self.expected_changed.append(d.req_id)
            if d.status.is_terminal:
                ended.append(d.req_id)
                self.live.discard(d.req_id)
        unknown = set(reply.cache_changes) - set(self.known)
        assert not unknown, f"rank {rank} reported hashes of no content it holds: {unknown}"
        report = InstanceReport(rank, reply.load, dict(reply.cache_changes), tuple(ended))
        self.placement.report(report, self.known)
        if self.twin is not None:
            take_report(self.twin, self.twin_views, report)
        for rid in ended:
            self._check_end_on_rank(rid, rank)

    def _check_rank(self, r: int, rank: ThreadRank, reply: StepReply) -> None:
        """After the round: the rank's last reply and the front-end's view of it are its
        state now; it holds exactly the live requests placed on it; the front-end's copy
        of each equals the rank's."""
        s = rank.engine.scheduler
        now = InstanceLoad(s.num_waiting, s.num_running, s.kv.usage)
        assert reply.load == now, f"rank {r} reported {reply.load}, holds {now}"
        view = self.dp.views[r]
        assert view.load == now, f"the front-end sees rank {r} as {view.load}; it holds {now}"
        cached = {h for h in self.known if s.kv.pool.lookup(h) is not None}
        assert view.cached == cached, f"rank {r}: viewed cached {view.cached}, holds {cached}"
        mine = {rid for rid in self.live if self.placed[rid] == r}
        assert set(s.requests) == mine, f"rank {r} holds {sorted(s.requests)}, want {sorted(mine)}"
        fresh = {d.req_id for d in reply.deltas}
        for rid in mine:  # a delta is sent when a step gives tokens (or ends the request)
            want, got = fields(s.requests[rid]), fields(self.reqs[rid])
            if rid not in fresh:  # the rest (its status, counters) may lag till then
                want, got = _outputs(want), _outputs(got)
            assert got == want, f"{rid}: the front-end's copy {got}, rank {r}'s {want}"
        if s.num_waiting:
            note("a rank reported a queue")
        if cached:
            note("a rank reported cached prefixes")

    def _check_end_on_rank(self, rid: str, rank: int) -> None:
        """A request its rank ended: rejected when it fits no rank, else finished with
        the scripted tokens of max_tokens or the rank's max_model_len; its copy is the
        rank's record of it."""
        req = self.reqs[rid]
        n = req.num_prompt_tokens
        engine = self.ranks[rank].engine
        if n > max(self.limits):
            note("rejected by its rank")
            assert (req.status, req.finish_reason) == (
                RequestStatus.REJECTED,
                FinishReason.REJECTED,
            ), f"{rid} ({n} tokens, limits {self.limits}) ended {req!r}"
            assert req.reject_reason and not req.output_token_ids, repr(req)
        else:
            k = min(self.max_tokens[rid], engine.max_model_len - n)
            want = [1000 + n + i for i in range(k)]
            got = (req.status, req.finish_reason, req.output_token_ids)
            assert got == (RequestStatus.FINISHED, FinishReason.LENGTH, want), f"{rid}: {got}"
        record = [rec for rec in engine.records if rec.req_id == rid][-1]
        t = req.times
        mirror = (
            req.status.value, req.num_output_tokens, t.first_scheduled, t.first_token,
            t.finish, t.token_times, max(req.num_cached_tokens, 0), req.num_preemptions,
            req.finish_reason, req.reject_reason,
        )  # fmt: skip
        on_rank = (
            record.status, record.num_output_tokens, record.first_scheduled,
            record.first_token, record.finish, record.token_times, record.num_cached_tokens,
            record.num_preemptions, record.finish_reason, record.reason,
        )  # fmt: skip
        assert mirror == on_rank, f"{rid}: the front-end's copy {mirror}, rank {rank}'s {on_rank}"
        self.ended_on_rank[rid] = fields(req)

    def _check_end_here(self, rid: str, reason: FinishReason, sent: bool) -> None:
        """A request the front-end ended: its rank ended it with the front-end's reason
        in the next round, or never heard of it if it was never sent."""
        records = [rec for rec in self.ranks[self.placed[rid]].engine.records if rec.req_id == rid]
        if not sent:
            assert not records, f"{rid} reached its rank after it ended unsent"
            return
        if rid in self.rank_ended_first:
            return  # its rank had ended it already (the reply was still unread)
        status = "aborted" if reason is FinishReason.ABORT else "finished"
        got = [(rec.status, rec.finish_reason) for rec in records]
        assert got == [(status, reason.value)], f"{rid} ended {reason} here; its rank: {got}"

    def _check_changed(self, changed: list[Request] | None) -> None:
        """`step` returned the front-end's own copies, each request once per delta it
        received, in the order the deltas came; every copy that changed is among them."""
        assert changed is not None
        got = [req.request_id for req in changed]
        assert got == self.expected_changed, f"step returned {got}, deltas {self.expected_changed}"
        assert all(req is self.reqs[req.request_id] for req in changed), "not the client's copy"
        now = {rid: fields(req) for rid, req in self.reqs.items()}
        moved = {rid for rid in now if now[rid] != self.snapshot[rid]}
        assert moved <= set(got), f"changed but not returned: {sorted(moved - set(got))}"
        self.snapshot = now

    @invariant()
    def the_front_end_holds_what_the_model_says(self) -> None:
        if not hasattr(self, "dp"):
            return
        dp = self.dp
        assert set(dp.requests) == self.live, (
            f"{sorted(dp.requests)} live, want {sorted(self.live)}"
        )
        assert all(dp.requests[rid] is self.reqs[rid] for rid in self.live)
        assert dp.rank_of == {rid: self.placed[rid] for rid in self.live}
        assert dp.has_unfinished() == bool(self.live)
        assert dp.num_steps == self.completed
        live = [sum(self.placed[rid] == r for rid in self.live) for r in range(len(self.ranks))]
        assert dp.router.outstanding == live, f"the router counts {dp.router.outstanding} live"

    def teardown(self) -> None:
        if not hasattr(self, "dp"):
            return
        failed = sys.exc_info()[1] is not None  # (hypothesis tears down in a finally)
        try:
            if failed:  # a rule's check failed: report that, not what draining then finds
                return
            steps = 0
            while self.live or self.owed:
                self.step()
                steps += 1
                assert steps < 300, f"never ended: {sorted(self.live)}"
            self._shut_down()
        finally:
            for rank in self.ranks:
                if rank.thread.is_alive():
                    rank.close()

    def _shut_down(self) -> None:
        """Stop reaches every rank still there (a gone rank's pipe error is no error),
        and the launcher's hook runs once."""
        calls: list[int] = []
        if self.hook:
            self.dp.on_shutdown = lambda: calls.append(1)
        for rank, gone in zip(self.ranks, self.gone, strict=True):
            rank.gone = gone
        self.dp.shutdown()
        self.dp.shutdown()
        assert calls == ([1] if self.hook else []), f"the shutdown hook ran {len(calls)} times"
        assert self.dp.on_shutdown is None
        for rank, gone in zip(self.ranks, self.gone, strict=True):
            if gone is None:
                rank.thread.join(WAIT_S)
                assert not rank.thread.is_alive() and rank.log[-1] == "stopped", rank.log[-3:]
            else:
                note("a rank gone at shutdown")
                rank.gone = None


# 60 examples under the ci and mutation profiles alike (each runs threads and a few
# engines: about 0.1 s), more under the deep one.
FrontEndMachine.TestCase.settings = settings(
    at_least(60), max_examples=max(60, settings.default.max_examples // 5),
    stateful_step_count=30, deadline=None,
)  # fmt: skip
test_the_front_end_and_its_ranks_follow_the_data_parallel_rules = FrontEndMachine.TestCase


class _Unstepped:
    """A rank the test never steps: placement needs none."""

    def send(self, obj: Any) -> None:
        raise AssertionError("this rank is never sent anything")

    def recv(self) -> Any:
        raise AssertionError("this rank is never read")


def test_the_front_end_places_with_its_own_router_and_seed() -> None:
    """Placement uses the front-end's router and seed (least-load and 0 when none is
    given): it places as a router of that name and seed fed the same requests. Pinned:
    power-of-two over three ranks places these requests differently under the seeds
    here (asserted), so a seed lost or replaced shows; the state machine reaches that
    case only now and then."""
    infos = [RankInfo(r, 64, 16, BS, 63, None, None, None) for r in range(3)]  # type: ignore[arg-type]
    placements: dict[tuple[str | None, int | None], list[int]] = {}
    for router, seed in ((None, None), ("power-of-two", None), ("power-of-two", 1),
                         ("power-of-two", 2)):  # fmt: skip
        options: dict[str, Any] = {} if seed is None else {"seed": seed}
        if router is not None:
            options["router"] = router
        dp = DataParallelEngine([_Unstepped()] * 3, infos, **options)
        twin = make_router(router or "least-load", 3, seed=seed or 0)
        views = views_of(BS, [63] * 3)
        got = placements[router, seed] = []
        for i in range(12):
            dp.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1)))
            want = twin.route(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1)), views)
            assert dp.rank_of[f"r{i}"] == want, f"{router}, seed {seed}: r{i} on {dp.rank_of}"
            got.append(want)
    assert placements[None, None] == [0, 1, 2] * 4, "least-load spreads a burst"
    drawn = [tuple(p) for (router, _), p in placements.items() if router is not None]
    assert len(set(drawn)) == 3, f"seeds alike: {placements}"


def test_a_delta_for_a_request_ended_meanwhile_is_passed_over() -> None:
    """Pinned: an interrupted step leaves a reply unread whose first delta is for a
    request the client then ends; the next step skips that delta and applies the rest
    (the machine's checks: the other request's copy, the changed list, the ends). The
    state machine reaches this only now and then."""
    m = FrontEndMachine()
    m.setup(n=1, blocks=[12] * 3, seqs=2, policy="least-load", seed=0, explicit=True,
            gone=[4] * 3, hook=False)  # fmt: skip
    try:
        m.arrive(run=(0, 1), tail=0, huge=False, max_tokens=6, burst=2)
        m.step()  # both requests prefill and run
        m.step_interrupted(at=0, ends=[0])  # r0 ends here while its delta is unread
        unread = len(m.wire)
        m.step()
        assert [d.req_id for d in m.wire[unread][1].deltas] == ["r0", "r1"], m.wire[unread]
        assert "r0" in m.ended_here and "r1" in m.live, (m.ended_here, m.live)
    finally:
        m.teardown()
