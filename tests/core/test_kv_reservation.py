"""A decode engine's request whose prompt KV is still on its way (`Request.awaiting_kv`):
its blocks are reserved as a start would take them, it is passed over until the KV has
arrived, then it decodes from its prompt (docs/design.md, "Clusters")."""

from __future__ import annotations

import pytest

from deepinfer.config import EngineRole
from deepinfer.request import Request, RequestStatus
from tests.factories import make_engine, make_request, run_to_completion


def _awaiting(req_id: str, prompt_len: int, max_tokens: int = 3) -> Request:
    req = make_request(req_id, prompt_len, max_tokens=max_tokens)
    req.awaiting_kv = True
    return req


def test_blocks_are_reserved_first_and_the_request_waits_for_its_kv() -> None:
    engine = make_engine(role="decode", block_size=4, num_gpu_blocks=10)
    req = _awaiting("a", 13)  # 13 tokens + its first output: 4 blocks
    assert engine.add_request(req) is None
    out = engine.schedule()
    assert out.is_empty and out.kv_reserved == ("a",)
    assert engine.scheduler.kv.pool.num_free_blocks == 10 - 4
    assert [r for r, _ in engine.take_kv_reserved()] == ["a"]
    assert engine.take_kv_reserved() == []  # taken once
    for _ in range(3):  # passed over, not a stall, while its KV is on its way
        assert engine.step() == []
        assert req.status is RequestStatus.PREFILLING and engine.has_unfinished()
    engine.kv_arrived("a")
    (sr,) = engine.schedule().scheduled
    # Its first step: the prompt's last token, on the blocks reserved (the whole table).
    assert (sr.num_computed_tokens, sr.num_tokens, sr.is_prompt) == (12, 1, False)
    assert sr.new_block_ids == [] and sr.block_table is not None and len(sr.block_table) == 4


def test_the_kv_goes_out_in_reservation_order_as_blocks_free() -> None:
    """Reserved in queue order, each when its blocks are free: the second waits (not
    sent) until the first has finished and freed them; then it is reserved."""
    engine = make_engine(role="decode", block_size=4, num_gpu_blocks=6)
    first, second = _awaiting("a", 15, max_tokens=2), _awaiting("b", 15, max_tokens=2)
    engine.add_request(first)
    engine.add_request(second)
    assert engine.schedule().kv_reserved == ("a",)  # 4 blocks of 6: b's 4 do not fit
    assert engine.schedule().kv_reserved == ()
    engine.kv_arrived("a")
    while first.status is not RequestStatus.FINISHED:
        engine.step()
    assert [r for r, _ in engine.take_kv_reserved()] == ["a", "b"]
    assert second.status is RequestStatus.PREFILLING and second.awaiting_kv
    engine.kv_arrived("b")
    run_to_completion(engine)
    assert second.num_output_tokens == 2


def test_a_request_whose_kv_arrived_is_not_counted_as_its_own_prefix_hit() -> None:
    engine = make_engine(role="decode", block_size=4, num_gpu_blocks=20)
    engine.add_request(make_request("x", 13, max_tokens=2))
    run_to_completion(engine)  # caches the 3 full blocks of the shared prompt
    req = _awaiting("y", 13)
    engine.add_request(req)
    engine.schedule()
    engine.kv_arrived("y")
    (sr,) = engine.schedule().scheduled
    assert sr.num_cached_blocks == 3  # the executor imports only the blocks past them
    assert req.num_cached_tokens == 12


def test_aborting_a_reserved_request_frees_its_blocks() -> None:
    engine = make_engine(role="decode", block_size=4, num_gpu_blocks=10)
    engine.add_request(_awaiting("a", 13))
    engine.schedule()
    engine.abort("a")
    assert engine.scheduler.kv.pool.num_free_blocks == 10 and not engine.has_unfinished()
    assert engine.records[-1].status == "aborted"
    with pytest.raises(ValueError, match="no reserved request"):
        engine.kv_arrived("a")


def test_reservations_count_against_max_num_seqs() -> None:
    engine = make_engine(role="decode", block_size=4, num_gpu_blocks=20, max_num_seqs=1)
    engine.add_request(_awaiting("a", 5))
    engine.add_request(_awaiting("b", 5))
    assert engine.schedule().kv_reserved == ("a",)
    assert engine.schedule().kv_reserved == ()


def test_only_a_decode_engine_takes_a_request_awaiting_its_kv() -> None:
    for role in (EngineRole.NORMAL, EngineRole.PREFILL):
        engine = make_engine(role=role)
        with pytest.raises(ValueError, match="only a decode engine imports"):
            engine.add_request(_awaiting("a", 5))


def test_a_decode_run_passes_over_reserved_requests_but_not_arrived_ones() -> None:
    engine = make_engine(role="decode", block_size=4, num_gpu_blocks=40)
    engine.add_request(make_request("run", 5, max_tokens=20))
    engine.step()
    engine.step()  # decoding
    engine.add_request(_awaiting("a", 5))
    engine.step()  # reserves a
    assert engine.scheduler.decode_run(None) is not None
    engine.kv_arrived("a")
    assert engine.scheduler.decode_run(None) is None  # a is scheduled next
