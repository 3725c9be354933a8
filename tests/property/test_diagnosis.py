"""The stall diagnosis reports the scheduler's state as it is.

`diagnose_stall(sched)` is what a stalled engine (`SchedulerStalled`) and the driver's liveness
failures print, so a wrong figure in it sends whoever reads it after the wrong cause.
It is only called when something already failed; here it is called after every step
of ordinary runs and read back: each figure must be the scheduler's own.

The diagnosis is four lines (three when nothing waits): the step and the queue
lengths; the cache's size, usage, free blocks, watermark and role; the head of the
waiting queue (its id, status, tokens, computed tokens, blocks held, blocks its tokens
need, whether it is a chunked prefill in progress); and the five largest block holders
with their block counts, largest first, or that no request holds blocks.
"""

from __future__ import annotations

import re

from hypothesis import example, given

from deepinfer.errors import SchedulerStalled
from deepinfer.kv_cache.manager import cdiv
from deepinfer.request import RequestStatus
from deepinfer.scheduler_checks import diagnose_stall, raise_stalled
from tests.property.examples import SEVEN_BLOCK_HOLDERS
from tests.property.harness import Checker, Driver, run_case
from tests.property.strategies import EngineCase, Workload, any_case_and_workload, scaled

_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_HOLDERS = "largest block holders: "
_NO_HOLDERS = "no block holders"


def _numbers(line: str) -> list[str]:
    return _NUMBER.findall(line)


class Diagnosis(Checker):
    """After every step and at the end, `diagnose_stall` (and what `raise_stalled` raises)
    states the scheduler's figures, read back from the text."""

    def __init__(self) -> None:
        self.steps = 0  # schedule() calls seen: the scheduler's step number

    def on_schedule(self, d: Driver, out: object, in_flight: bool) -> None:
        self.steps += 1

    def on_step_end(self, d: Driver) -> None:
        self._check(d)

    def on_end(self, d: Driver) -> None:
        self._check(d)

    def _check(self, d: Driver) -> None:
        s, cfg = d.sched, d.case.config
        text = diagnose_stall(s)
        try:
            raise_stalled(s)
        except SchedulerStalled as e:
            assert str(e) == text, f"raise_stalled carries {str(e)!r}, not the diagnosis"
        else:
            raise AssertionError("raise_stalled returned")
        waiting = list(s.waiting)
        head = waiting[0] if waiting else None  # the simulator compiles no grammar
        lines = text.split("\n")
        assert len(lines) == (4 if head is not None else 3), f"diagnosis lines:\n{text}"
        summary, cache, *rest = lines
        want = [str(self.steps), str(len(s.running)), str(len(waiting))]
        assert _numbers(summary) == want, f"summary {summary!r}: step, running, waiting {want}"
        kv = s.kv
        nums = _numbers(cache)
        want = [str(cfg.num_gpu_blocks), str(cfg.block_size), f"{kv.usage:.3f}"]
        want += [str(kv.pool.num_free_blocks)]
        assert nums[:4] == want and float(nums[4]) == cfg.prefill_watermark, (
            f"cache line {cache!r}: blocks, block size, usage, free, watermark {want}"
        )
        assert cfg.role.value in cache, f"cache line {cache!r} does not name the role"
        if head is not None:
            self._check_head(d, head, rest[0])
        self._check_holders(d, rest[-1])

    @staticmethod
    def _check_head(d: Driver, head: object, line: str) -> None:
        s = d.sched
        rid = head.request_id  # type: ignore[attr-defined]
        assert repr(rid) in line, f"head line {line!r} does not name the head {rid!r}"
        assert head.status.value in line, f"head line {line!r}: status {head.status}"  # type: ignore[attr-defined]
        prefilling = head.status is RequestStatus.PREFILLING  # type: ignore[attr-defined]
        want = [
            str(head.num_tokens),  # type: ignore[attr-defined]
            str(head.num_computed_tokens),  # type: ignore[attr-defined]
            str(len(s.kv.req_blocks.get(rid, ()))),
            str(cdiv(head.num_tokens, s.block_size)),  # type: ignore[attr-defined]
        ]
        nums = _numbers(line.replace(repr(rid), ""))
        assert nums == want, f"head line {line!r}: tokens, computed, held, needed {want}"
        assert line.endswith(str(prefilling)), f"head line {line!r}: in progress {prefilling}"

    @staticmethod
    def _check_holders(d: Driver, line: str) -> None:
        held = {rid: len(blocks) for rid, blocks in d.sched.kv.req_blocks.items()}
        if not held:
            assert line == _NO_HOLDERS, f"nobody holds blocks, yet {line!r}"
            return
        assert line.startswith(_HOLDERS), f"{held} hold blocks, yet {line!r}"
        listed = [item.rsplit("=", 1) for item in line[len(_HOLDERS) :].split(", ")]
        counts = [int(n) for _, n in listed]
        names = [rid for rid, _ in listed]
        assert len(listed) == min(5, len(held)), f"{line!r} lists not the 5 largest of {held}"
        assert all(held.get(rid) == n for rid, n in zip(names, counts)), f"{line!r} vs {held}"
        assert counts == sorted(counts, reverse=True), f"{line!r} not largest first"
        assert all(n <= counts[-1] for rid, n in held.items() if rid not in names), (
            f"{line!r} leaves out a larger holder of {held}"
        )


@scaled(0.5)
@given(any_case_and_workload())
@example(SEVEN_BLOCK_HOLDERS)
def test_the_stall_diagnosis_reports_the_queues_the_cache_the_head_and_the_largest_holders(
    cw: tuple[EngineCase, Workload],
) -> None:
    """At any point of a run, `diagnose_stall` gives the step number, the running and
    waiting counts, the cache's blocks, block size, usage, free blocks, watermark and
    role, the head of waiting (id, status, tokens, computed, blocks held and needed,
    whether a chunked prefill is in progress), and the (at most five) largest block
    holders, largest first, with their exact counts (or says nobody holds blocks);
    `raise_stalled` raises exactly that text.

    Caught: `diagnose__mutmut_12` (the in-progress flag negated), `_15` (holders sorted
    by id, not size), `_19` (smallest first), `_20` (six holders listed), `_13` / `_22`
    (holders dropped), `_23` (an empty holders list), and every mutant that crashes the
    diagnosis or loses a line."""
    case, workload = cw
    run_case(case, workload, Diagnosis())
