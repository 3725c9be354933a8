"""The step log file: a header, then one line a step, read back as written; anything
malformed is an error naming the file and the line."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.executor import StepHandle
from deepinfer.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from deepinfer.records import StepRecord
from deepinfer.step_log_file import (
    LoggedStep,
    StepLogWriter,
    read_step_log,
    step_groups,
    step_log_header,
)
from tests.factories import ScriptedExecutor, StepClock, make_config, make_request


def _out(step_id: int, shapes: list[tuple[int, int, bool, int]]) -> SchedulerOutput:
    return SchedulerOutput(
        step_id,
        [
            ScheduledRequest(f"r{i}", q, c, p, True, [], draft_token_ids=[7] * d)
            for i, (q, c, p, d) in enumerate(shapes)
        ],
    )


def _record(step_id: int, duration: float = 0.01) -> StepRecord:
    return StepRecord(step_id, 1.0 + step_id, duration, 2, 0, 3, 2, 2, 0.1, 0)


def _header() -> dict:
    return step_log_header("deepseek-v2-lite", "h200", EngineConfig(), "torch", {"dtype": "bf16"})


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text(json.dumps(_header()) + "\n" + "".join(line + "\n" for line in lines))
    return path


def test_a_steps_requests_are_its_groups_equal_ones_counted_once() -> None:
    """A profile point's groups: [count, query, context, is_prompt] (+ drafts verified),
    sorted, so a step's requests in any order give the same line."""
    out = _out(0, [(1, 40, False, 0), (64, 0, True, 0), (1, 40, False, 0), (3, 12, False, 2)])
    assert step_groups(out) == [[2, 1, 40, False], [1, 3, 12, False, 2], [1, 64, 0, True]]
    shuffled = _out(0, [(3, 12, False, 2), (1, 40, False, 0), (64, 0, True, 0), (1, 40, False, 0)])
    assert step_groups(shuffled) == step_groups(out)


def test_the_writer_writes_what_the_reader_reads(tmp_path: Path) -> None:
    path = tmp_path / "run" / "steps.jsonl"
    with StepLogWriter(path, _header()) as writer:
        out = _out(3, [(1, 40, False, 0), (64, 0, True, 0)])
        writer.scheduled(out, 0.002)
        writer.applied(out, _record(3), 0.001, overlapped=True)
        writer.scheduled(_out(4, []), 0.5)  # an empty step is never applied
    log = read_step_log(path)
    assert (
        log.header["model"] == "deepseek-v2-lite"
        and log.engine["block_size"] == EngineConfig().block_size
    )
    (step,) = log.steps
    assert step.line == 2 and step.record == _record(3)
    assert step.groups == [[1, 1, 40, False], [1, 64, 0, True]]
    assert (step.schedule_s, step.process_s, step.overlapped) == (0.002, 0.001, True)
    assert step.host_s == pytest.approx(0.003)


class _TimedHandle(StepHandle):
    """A launch that times its device: the span is read only once `passed` is set."""

    times_device = True

    def __init__(self, span: float) -> None:
        self.span, self.passed, self.waited = span, False, False

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        return ModelRunnerOutput()

    def device_seconds(self, wait: bool = False) -> float | None:
        self.waited |= wait
        return self.span if self.passed or wait else None


def test_a_steps_device_span_is_written_once_read_and_absent_where_untimed(
    tmp_path: Path,
) -> None:
    """A launch that times its device (the torch executor on CUDA) gives its step's line
    the device span, read without waiting when the next step is applied (by then the
    device has passed it; a span it has not passed is left out, never waited for) or,
    for the last step, at close; a launch that does not time its device (the simulator,
    a CPU) writes its line at once, with no device_s."""
    path = tmp_path / "steps.jsonl"
    one, two, last = _TimedHandle(0.004), _TimedHandle(0.006), _TimedHandle(0.008)
    with StepLogWriter(path, _header()) as writer:
        writer.applied(_out(1, [(1, 40, False, 0)]), _record(1), 0.001, True, one)
        assert writer.num_steps == 0  # (its line waits for its span)
        one.passed = True
        writer.applied(_out(2, [(1, 41, False, 0)]), _record(2), 0.001, True, two)
        assert writer.num_steps == 1
        writer.applied(_out(3, [(1, 42, False, 0)]), _record(3), 0.001, False)
        assert writer.num_steps == 3
        writer.applied(_out(4, [(1, 43, False, 0)]), _record(4), 0.001, True, last)
    log = read_step_log(path)
    assert [s.device_s for s in log.steps] == [0.004, None, None, 0.008]
    assert last.waited and not (one.waited or two.waited)
    assert [s.seconds for s in log.steps] == [0.004, 0.01, 0.01, 0.008]


def test_a_span_already_passed_is_written_at_once_and_flush_writes_the_waiting_one(
    tmp_path: Path,
) -> None:
    """A step whose span the device has passed when it is applied is written then; one
    it has not waits, and `flush` (the engine with nothing in flight) writes it, waiting:
    an idle or stopped engine's last step is on disk without a close."""
    path = tmp_path / "steps.jsonl"
    done, waiting = _TimedHandle(0.004), _TimedHandle(0.006)
    done.passed = True
    writer = StepLogWriter(path, _header())
    writer.applied(_out(1, [(1, 40, False, 0)]), _record(1), 0.001, True, done)
    assert writer.num_steps == 1 and not done.waited
    writer.applied(_out(2, [(1, 41, False, 0)]), _record(2), 0.001, True, waiting)
    assert writer.num_steps == 1
    writer.flush()
    assert writer.num_steps == 2 and waiting.waited
    assert [s.device_s for s in read_step_log(path).steps] == [0.004, 0.006]  # (not closed)
    writer.flush()  # nothing waits: nothing written
    writer.close()
    assert len(read_step_log(path).steps) == 2


def test_a_launch_s_host_seconds_go_with_its_device_span_only(tmp_path: Path) -> None:
    """Each launch's host seconds reach its own step's line where the launch times its
    device (beside device_s, they tell a launch-bound step from a device-bound one); an
    untimed launch (the simulator's, a CPU's) writes none, and a failed step's launch
    time is not given to the next."""
    path = tmp_path / "steps.jsonl"
    timed = _TimedHandle(0.004)
    timed.passed = True
    with StepLogWriter(path, _header()) as writer:
        writer.launched(_out(1, [(1, 40, False, 0)]), 0.5)  # (step 1 failed: never applied)
        out = _out(2, [(1, 40, False, 0)])
        writer.launched(out, 0.003)
        writer.applied(out, _record(2), 0.001, True, timed)
        out = _out(3, [(1, 41, False, 0)])
        writer.launched(out, 0.002)
        writer.applied(out, _record(3), 0.001, False)
        out = _out(4, [(1, 42, False, 0)])
        writer.applied(out, _record(4), 0.001, True, _TimedHandle(0.005))
    log = read_step_log(path)
    assert [s.launch_s for s in log.steps] == [0.003, None, None]
    assert [s.device_s for s in log.steps] == [0.004, None, 0.005]
    assert writer._launch_s == {}


class _SlowLaunchExecutor(ScriptedExecutor):
    """Each launch spends step k's k milliseconds of the host's time and returns a handle
    that times its device (as the torch executor's on CUDA)."""

    def execute_async(self, out):  # type: ignore[no-untyped-def]
        time.sleep(out.step_id * 1e-3)
        return _TimedResult(self.execute(out))


class _TimedResult(_TimedHandle):
    def __init__(self, value: ModelRunnerOutput) -> None:
        super().__init__(0.001)
        self.passed, self.value = True, value

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        return self.value


def test_the_engine_logs_each_launchs_host_seconds(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    cfg = make_config(num_gpu_blocks=40)
    writer = StepLogWriter(path, _header())
    engine = EngineCore(cfg, _SlowLaunchExecutor(40), clock=StepClock(), step_writer=writer)
    engine.add_request(make_request("a", 4, max_tokens=5))
    while engine.has_unfinished():
        engine.step()
    writer.close()
    steps = read_step_log(path).steps
    assert len(steps) == 5
    for step in steps:
        slept = step.record.step_id * 1e-3
        assert step.launch_s is not None and slept <= step.launch_s < slept + 0.05, step


class _FailedDevice(_TimedHandle):
    def device_seconds(self, wait: bool = False) -> float | None:
        if wait:
            raise RuntimeError("CUDA error: device-side assert triggered")
        return None


def test_a_device_that_failed_leaves_the_line_without_its_span_and_the_file_closed(
    tmp_path: Path,
) -> None:
    """The run's own error is what the caller sees, not the event's: close writes the
    step without device_s and closes the file."""
    path = tmp_path / "steps.jsonl"
    writer = StepLogWriter(path, _header())
    with pytest.raises(ValueError, match="the run's own"), writer:
        writer.applied(_out(1, [(1, 40, False, 0)]), _record(1), 0.001, True, _FailedDevice(1))
        raise ValueError("the run's own error")
    assert writer._file.closed
    assert [s.device_s for s in read_step_log(path).steps] == [None]


def test_a_step_run_alone_is_timed_by_its_duration_a_pipelined_one_by_its_span() -> None:
    """A profile point times `executor.execute`, host work included: a step run alone is
    that (its duration); a pipelined step's duration can hold the next launch's host work,
    so its device span stands for it."""
    alone = LoggedStep(2, _record(1, 0.010), [], 0.0, 0.0, False, 0.007)
    piped = LoggedStep(3, _record(2, 0.010), [], 0.0, 0.0, True, 0.007)
    assert (alone.seconds, piped.seconds) == (0.010, 0.007)


def test_a_priced_host_time_replaces_the_measured_one(tmp_path: Path) -> None:
    """The simulator's host time is its cost model's price, written as the schedule's."""
    path = tmp_path / "sim.jsonl"
    with StepLogWriter(path, _header(), host_price=lambda out: 0.25 * len(out.scheduled)) as w:
        out = _out(1, [(1, 40, False, 0), (1, 50, False, 0)])
        w.scheduled(out, 9.0)
        w.applied(out, _record(1), 9.0, overlapped=False)
    (step,) = read_step_log(path).steps
    assert (step.schedule_s, step.process_s) == (0.5, 0.0)


def test_a_failed_steps_schedule_time_is_not_given_to_the_next(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    with StepLogWriter(path, _header()) as writer:
        failed, ok = _out(1, [(1, 4, False, 0)]), _out(2, [(1, 5, False, 0)])
        writer.scheduled(failed, 0.7)
        writer.scheduled(ok, 0.1)
        writer.applied(ok, _record(2), 0.0, overlapped=False)
        later = _out(3, [(1, 6, False, 0)])
        writer.applied(later, _record(3), 0.0, overlapped=False)
    steps = read_step_log(path).steps
    assert [s.schedule_s for s in steps] == [0.1, 0.0]


GOOD = json.dumps(
    {**_record(1).__dict__, "groups": [[1, 1, 40, False]], "schedule_s": 0.001,
     "process_s": 0.001, "overlapped": False}
)  # fmt: skip


@pytest.mark.parametrize(
    "line, says",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        (GOOD.replace('"schedule_s"', '"other"'), "no 'schedule_s'"),
        (GOOD.replace('"duration": 0.01', '"duration": -1'), "duration -1: must be"),
        (GOOD.replace("[[1, 1, 40, false]]", "[]"), "groups []"),
        (GOOD.replace("[[1, 1, 40, false]]", "[[0, 1, 40, false]]"), "group [0, 1, 40, False]"),
        (GOOD.replace("[[1, 1, 40, false]]", "[[1, 1, 40, 1]]"), "group [1, 1, 40, 1]"),
        (GOOD.replace('"duration": 0.01', '"duration": Infinity'), "duration inf"),
        (GOOD.replace('"overlapped": false', '"overlapped": "false"'), "overlapped 'false'"),
        (
            re.sub(r'"num_scheduled_reqs": \d+', '"num_scheduled_reqs": "three"', GOOD),
            "num_scheduled_reqs 'three'",
        ),
        (re.sub(r'"num_running": \d+', '"num_running": 1.5', GOOD), "num_running 1.5"),
        (GOOD.replace('"overlapped"', '"device_s": -0.5, "overlapped"'), "device_s -0.5"),
        (GOOD.replace('"overlapped"', '"launch_s": "x", "overlapped"'), "launch_s 'x'"),
    ],
)
def test_a_malformed_step_names_the_file_and_line(tmp_path: Path, line: str, says: str) -> None:
    path = _write(tmp_path / "bad.jsonl", [GOOD, line, GOOD])
    with pytest.raises(ValueError, match=f"bad.jsonl:3: .*{re.escape(says)}"):
        read_step_log(path)


def test_a_file_that_is_not_a_step_log_is_refused_at_its_first_line(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"id": "r0", "arrival": 0.0, "prompt_len": 5, "output_len": 3}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1: not a deepinfer step log"):
        read_step_log(trace)
    newer = tmp_path / "newer.jsonl"
    newer.write_text(json.dumps(_header() | {"version": 99}) + "\n")
    with pytest.raises(ValueError, match="newer.jsonl:1: step log version 99"):
        read_step_log(newer)
    with pytest.raises(ValueError, match="missing.jsonl: cannot read the step log"):
        read_step_log(tmp_path / "missing.jsonl")


def test_a_last_line_cut_short_is_left_out(tmp_path: Path) -> None:
    """A server killed while writing leaves a partial last line: the whole lines stand."""
    path = _write(tmp_path / "cut.jsonl", [GOOD])
    path.write_text(path.read_text() + GOOD[:40])
    assert len(read_step_log(path).steps) == 1
