"""A decode engine's reservations for KV on its way (docs/design.md, "Roles": role
decode, `Request.awaiting_kv`), as a hypothesis state machine.

Requests arrive awaiting their KV or with it, their KV arrives in any order, steps and
aborts interleave, under either scheduling mode. The rules, both ways:
- safety: a request awaiting its KV is never scheduled; its blocks, once reserved, are
  its whole prompt's; reservations are made in queue order; its first step after the
  KV arrived is the prompt's last token alone, not a prompt step, with its whole block
  table and its own prefix hits as the blocks the import skips;
- progress: when the head of the queue awaits its KV unreserved after a schedule, that
  schedule could not reserve it (a preemption, the token budget spent, the sequence
  limit, or too few free blocks); once every KV has arrived, every request ends with
  its tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from deepinfer.engine import EngineCore
from deepinfer.kv_cache.manager import cdiv
from deepinfer.outputs import SchedulerOutput
from deepinfer.request import Request, RequestStatus
from tests.factories import make_engine, make_request, run_to_completion
from tests.property.harness import note
from tests.property.strategies import scaled

BS = 4


class ReservationMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(6, 24),
        max_num_seqs=st.integers(1, 4),
        budget=st.sampled_from([4, 8, 32]),
        async_scheduling=st.booleans(),
    )
    def setup(
        self, num_blocks: int, max_num_seqs: int, budget: int, async_scheduling: bool
    ) -> None:
        self.engine: EngineCore = make_engine(
            role="decode",
            block_size=BS,
            num_gpu_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            async_scheduling=async_scheduling,
        )
        self.requests: dict[str, Request] = {}
        self.order: dict[str, int] = {}  # request id -> its place in arrival order
        self.reserved_order: list[str] = []
        self.arrived: set[str] = set()  # KV arrived, not scheduled here yet
        self.count = 0
        sched = self.engine.scheduler
        schedule = sched.schedule

        def checked() -> SchedulerOutput:
            out = schedule()
            self._check(out)
            return out

        sched.schedule = checked  # type: ignore[method-assign]

    def _check(self, out: SchedulerOutput) -> None:
        sched = self.engine.scheduler
        for sr in out.scheduled:
            req = self.requests[sr.req_id]
            assert not req.awaiting_kv, f"{sr.req_id} scheduled before its KV arrived"
            if sr.req_id in self.arrived:  # its first step here, on the reserved blocks
                self.arrived.discard(sr.req_id)
                note("reserved request's first step")
                assert (sr.num_tokens, sr.num_computed_tokens, sr.is_prompt) == (
                    1,
                    req.num_prompt_tokens - 1,
                    False,
                ), sr
                assert sr.block_table is not None
                assert len(sr.block_table) == cdiv(req.num_prompt_tokens, BS)
                assert sr.num_cached_blocks * BS == req.num_cached_tokens
        for rid in out.kv_reserved:
            note("reserved")
            req = self.requests[rid]
            held = len(sched.kv.req_blocks[rid])
            assert held == cdiv(req.num_tokens, BS), (rid, held)
            assert req.awaiting_kv and req.status is RequestStatus.PREFILLING
            self.reserved_order.append(rid)
        places = [self.order[r] for r in self.reserved_order]
        assert places == sorted(places), f"reserved out of queue order: {self.reserved_order}"
        head = sched.waiting.peek()
        if head is not None and head.awaiting_kv and head.status is RequestStatus.WAITING:
            held_back = (
                len(sched.running) + sched.waiting.num_in_progress >= sched.config.max_num_seqs
            )
            spent = out.num_batched_tokens >= sched.config.max_num_batched_tokens
            short = sched.kv.pool.num_free_blocks < cdiv(head.num_tokens, BS)
            assert out.preempted_req_ids or held_back or spent or short, (
                f"{head.request_id} could have been reserved: "
                f"{sched.kv.pool.num_free_blocks} free blocks"
            )
            note("reservation waits")

    @rule(prompt=st.integers(1, 20), max_tokens=st.integers(1, 6), awaiting=st.booleans())
    def add(self, prompt: int, max_tokens: int, awaiting: bool) -> None:
        rid = f"r{self.count}"
        self.count += 1
        req = make_request(rid, prompt, max_tokens=max_tokens)
        req.awaiting_kv = awaiting
        self.order[rid] = len(self.order)
        if self.engine.add_request(req) is None:
            self.requests[rid] = req

    def _awaiting_reserved(self) -> list[str]:
        return [r for r in self.reserved_order if self.requests[r].awaiting_kv]

    @precondition(lambda self: any(self.requests[r].awaiting_kv for r in self.reserved_order))
    @rule(pick=st.integers(0, 100))
    def kv_arrives(self, pick: int) -> None:
        waiting = self._awaiting_reserved()
        rid = waiting[pick % len(waiting)]
        self.engine.kv_arrived(rid)
        self.arrived.add(rid)

    @precondition(lambda self: bool(self.requests))
    @rule(pick=st.integers(0, 100))
    def kv_arrives_unasked(self, pick: int) -> None:
        """Only a reserved request still awaiting its KV takes one: any other (not
        reserved yet, arrived already, running, ended) is refused by name."""
        awaiting = set(self._awaiting_reserved())
        others = [r for r in self.requests if r not in awaiting]
        if not others:
            return
        rid = others[pick % len(others)]
        with pytest.raises(ValueError, match=f"kv_arrived\\({rid!r}\\): no reserved request"):
            self.engine.kv_arrived(rid)
        note("an unasked KV refused")

    @rule()
    def step(self) -> None:
        self.engine.step()

    @precondition(lambda self: any(not r.is_finished for r in self.requests.values()))
    @rule(pick=st.integers(0, 100))
    def abort(self, pick: int) -> None:
        live = [r for r, q in self.requests.items() if not q.is_finished]
        rid = live[pick % len(live)]
        self.engine.abort(rid)
        self.arrived.discard(rid)

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        # Every KV arrives as soon as its blocks are reserved; a step serves a token at
        # least, so the work left bounds the steps (a preemption's recompute twice over).
        work = sum(r.num_tokens + r.max_tokens for r in self.requests.values())
        for _ in range(3 * work + 10):
            for rid in self._awaiting_reserved():
                self.engine.kv_arrived(rid)
                self.arrived.add(rid)
            if not self.engine.has_unfinished():
                break
            self.engine.step()
        run_to_completion(self.engine, max_steps=10)
        for rid, req in self.requests.items():
            assert req.is_finished, rid
            if req.status is RequestStatus.FINISHED:  # its tokens, or up to max_model_len
                limit = self.engine.max_model_len
                assert req.num_output_tokens == req.max_tokens or req.num_tokens == limit, req
        assert self.engine.scheduler.kv.pool.num_free_blocks == self.engine.scheduler.kv.num_blocks


def test_a_decode_engine_reserves_for_kv_on_its_way_by_its_rules() -> None:
    run_state_machine_as_test(
        ReservationMachine,
        settings=settings(scaled(0.2), stateful_step_count=40, deadline=None),
    )


def test_only_a_decode_engine_takes_a_request_awaiting_its_kv() -> None:
    """Only a decode engine imports a prompt's KV (docs/design.md, "Roles"): an engine of
    another role refuses a request awaiting one, naming the request and its own role,
    and neither queues nor counts it. (Kills `Scheduler.add_request__mutmut_5`, the
    refusal without its message.)"""
    for role in ("normal", "prefill"):
        engine = make_engine(role=role, block_size=BS, num_gpu_blocks=8)
        req = make_request("r0", 5, max_tokens=2)
        req.awaiting_kv = True
        with pytest.raises(ValueError) as refused:
            engine.add_request(req)
        assert "'r0'" in str(refused.value) and repr(role) in str(refused.value), refused.value
        sched = engine.scheduler
        assert (sched.num_submitted, len(sched.waiting), engine.has_unfinished()) == (0, 0, False)
