"""Attention data parallelism without processes: the front-end over
in-process ranks (the same rank loop the spawned ranks run, behind a pickling pipe)."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest

from deepinfer.config import EngineConfig
from deepinfer.data_parallel.front_end import DataParallelEngine, RankFailed
from deepinfer.data_parallel.protocol import StepCommand, StepReply, Stop
from deepinfer.data_parallel.rank_loop import run_command
from deepinfer.data_parallel.request_sync import DeltaTracker
from deepinfer.engine import EngineCore
from deepinfer.request import FinishReason, RequestStatus
from tests.factories import make_engine, make_request, rank_info, run_to_completion


class LoopbackRank:
    """A rank in this process: commands and replies are pickled as over a pipe, so the
    front-end's requests and the rank's are separate objects."""

    def __init__(self, rank: int, engine: EngineCore) -> None:
        self.rank, self.engine = rank, engine
        self.tracker = DeltaTracker()
        self.reply: StepReply | None = None
        self.steps = 0
        self.interrupt = False  # the next recv raises KeyboardInterrupt (Ctrl-C)

    def send(self, obj: Any) -> None:
        if isinstance(obj, Stop):
            return
        cmd: StepCommand = pickle.loads(pickle.dumps(obj))
        self.steps += 1
        self.reply = run_command(self.rank, self.engine, cmd, self.tracker)

    def recv(self) -> Any:
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        return pickle.loads(pickle.dumps(self.reply))


def _front_end(
    n: int, router: str = "least-load", **config: Any
) -> tuple[DataParallelEngine, list[LoopbackRank]]:
    ranks = [LoopbackRank(r, make_engine(**config)) for r in range(n)]
    infos = [rank_info(r, rank.engine) for r, rank in enumerate(ranks)]
    return DataParallelEngine(ranks, infos, router=router), ranks


def test_outputs_equal_one_engine_and_every_rank_keeps_its_invariants() -> None:
    """Invariants are checked on every rank after every step (make_engine(check=True))."""
    lengths = [(5, 3), (9, 12), (3, 1), (12, 6), (7, 9)]
    one = make_engine()
    alone = [make_request(f"r{i}", p, max_tokens=m) for i, (p, m) in enumerate(lengths)]
    for req in alone:
        one.add_request(req)
    run_to_completion(one)
    want = {r.request_id: r.output_token_ids for r in alone}
    dp, ranks = _front_end(2)
    reqs = [make_request(f"r{i}", p, max_tokens=m) for i, (p, m) in enumerate(lengths)]
    for req in reqs:
        dp.add_request(req)
    placed = dict(dp.rank_of)
    assert sorted(placed.values()) == [0, 0, 0, 1, 1]
    steps = 0
    while dp.has_unfinished():
        dp.step()
        steps += 1
        assert steps < 100
    assert {r.request_id: r.output_token_ids for r in reqs} == want
    assert all(r.status is RequestStatus.FINISHED and r.finish_reason == "length" for r in reqs)
    assert all(r.times.first_token is not None and r.times.finish is not None for r in reqs)
    for rank in ranks:  # each request was served by the rank it was placed on, only
        served = {rec.req_id for rec in rank.engine.records}
        assert served == {rid for rid, r in placed.items() if r == rank.rank}
        assert not rank.engine.has_unfinished()
        assert rank.steps == steps  # every rank steps every round (lock-step)


def test_a_rank_finishes_its_request_while_the_other_is_busy() -> None:
    dp, ranks = _front_end(2)
    short, long = make_request("short", 4, max_tokens=1), make_request("long", 4, max_tokens=8)
    dp.add_request(short)
    dp.add_request(long)
    first = dp.step()  # both prefill; `short` ends with its first token
    assert short.is_finished and not long.is_finished and set(first) == {short, long}
    assert not ranks[0].engine.has_unfinished() and ranks[1].engine.has_unfinished()
    while dp.has_unfinished():
        assert dp.step() == [long]
    assert long.num_output_tokens == 8 and ranks[0].engine.scheduler.kv.usage == 0.0


def test_a_stop_from_the_front_end_frees_the_request_on_its_rank() -> None:
    dp, ranks = _front_end(2)
    a, b = make_request("a", 4, max_tokens=20), make_request("b", 4, max_tokens=20)
    dp.add_request(a)
    dp.add_request(b)
    dp.step()
    assert dp.finish("a", FinishReason.STOP) is a and a.status is RequestStatus.FINISHED
    assert dp.finish("a", FinishReason.STOP) is None
    tokens = list(a.output_token_ids)
    dp.step()
    assert a.output_token_ids == tokens  # nothing more arrives for it
    assert [(r.req_id, r.status) for r in ranks[0].engine.records] == [("a", "finished")]
    assert ranks[0].engine.scheduler.kv.usage == 0.0
    unsent = make_request("c", 4)
    dp.add_request(unsent)
    dp.abort("c")  # aborted before any step sent it: its rank never hears of it
    dp.abort("b")
    dp.step()
    assert [r.req_id for rank in ranks for r in rank.engine.records] == ["a", "b"]
    assert not dp.has_unfinished() and unsent.status is RequestStatus.ABORTED


def test_a_rank_rejection_comes_back_with_its_reason() -> None:
    dp, _ = _front_end(2)
    huge = make_request("huge", 100)  # 10 blocks of 4 tokens hold 40
    dp.add_request(huge)
    assert dp.step() == [huge]
    assert huge.status is RequestStatus.REJECTED and "100" in (huge.reject_reason or "")
    assert not dp.has_unfinished()


def test_a_failing_rank_is_reported_with_its_number_after_every_rank_answered() -> None:
    dp, ranks = _front_end(2)
    for i in range(2):
        dp.add_request(make_request(f"r{i}", 4, max_tokens=3))

    def boom(out: Any) -> Any:
        raise ZeroDivisionError("bad step")

    broken = copy.copy(ranks[1].engine.executor)
    broken.execute_async = boom  # type: ignore[method-assign]
    ranks[1].engine.executor = broken
    dp.step()  # an executor error aborts that step's requests (EngineCore._fail)
    assert dp.requests.keys() == {"r0"}

    def stall() -> Any:
        raise RuntimeError("scheduler broke")

    ranks[0].engine.step = stall  # type: ignore[method-assign]
    with pytest.raises(RankFailed, match="data-parallel rank 0: RuntimeError: scheduler broke"):
        dp.step()
    assert ranks[1].steps == 2  # the other rank still ran its round


def test_an_interrupted_step_leaves_no_reply_unread() -> None:
    """Ctrl-C while waiting for rank 1: the next step reads its owed reply first, so the
    front-end and the ranks stay in step and no token is lost."""
    dp, ranks = _front_end(2)
    reqs = [make_request(f"r{i}", 4, max_tokens=5) for i in range(2)]
    for req in reqs:
        dp.add_request(req)
    ranks[1].interrupt = True
    with pytest.raises(KeyboardInterrupt):
        dp.step()
    while dp.has_unfinished():
        dp.step()
    assert [r.output_token_ids for r in reqs] == [[1004 + i for i in range(5)]] * 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "needs data_parallel_size > 1"),
        ({"data_parallel_size": 2, "async_scheduling": True}, "async_scheduling=True"),
        ({"data_parallel_size": 2, "batch_invariant": True}, "batch_invariant=True"),
    ],
)
def test_expert_parallel_layouts_it_cannot_serve_are_refused_by_name(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(enable_expert_parallel=True, **fields)  # type: ignore[arg-type]


def test_prefix_affinity_follows_the_prefix_the_ranks_really_cache() -> None:
    """The ranks report the blocks they cache; a prompt sharing a prefix goes to the rank
    that holds it, even when least-load would send it elsewhere."""
    dp, ranks = _front_end(2, router="prefix-affinity", block_size=4, num_gpu_blocks=32)
    shared = list(range(50, 62))  # three full blocks
    dp.add_request(make_request("a", [*shared, 1], max_tokens=1))
    dp.add_request(make_request("b", [9, 8, 7, 6, 5], max_tokens=30))
    while "a" in dp.requests:
        dp.step()
    assert dp.rank_of == {"b": 1}
    assert ranks[0].engine.scheduler.kv.usage == 0.0  # rank 0 idle, its prefix cached
    dp.add_request(make_request("c", [*shared, 2], max_tokens=1))
    assert dp.rank_of["c"] == 0 and dp.views[0].cached_prefix_blocks(dp.requests["c"]) == 3
    dp.add_request(make_request("d", [40, 41, 42, 43, 44], max_tokens=1))
    assert dp.rank_of["d"] == 0  # no prefix anywhere: least outstanding, tied: lowest index
    with pytest.raises(ValueError, match="router 'nearest'"):
        _front_end(2, router="nearest")


@pytest.mark.parametrize(
    "drafts", [dict(num_speculative_tokens=3), dict(enable_mtp_varlen=True)], ids=["k3", "varlen"]
)
def test_expert_parallel_ranks_speculate_with_async_scheduling_off(
    drafts: dict[str, object],
) -> None:
    """The ranks run the same number of MTP passes a round (the most any rank drafts):
    speculation is served with expert parallelism; async scheduling stays refused."""
    cfg = EngineConfig(data_parallel_size=8, enable_expert_parallel=True, **drafts)  # type: ignore[arg-type]
    assert cfg.num_speculative_tokens in (3, 5) and cfg.async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling=True"):
        cfg.replace(async_scheduling=True)
