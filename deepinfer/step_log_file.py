"""The step log as a file: what a run (served, replayed or simulated) writes so that a
profile can be fitted from its steps alone (`deepinfer profile --from-log`).

JSON Lines. The first line is the header, what the steps calibrate:

    {"format": "deepinfer-step-log", "version": 1, "model": ..., "hardware": ...,
     "executor": "torch" | "sim", "engine": EngineConfig.to_dict(), "meta": {...}}

`meta` holds what a profile's meta holds of the executor (device, dtype, kernels, CUDA
graphs, piecewise_max_tokens, versions, commit), so the fit knows what it measured.
Every other line is one applied step: the fields of its StepRecord (`duration` is the
step's time from its launch, or from the end of the step before where that is later, to
its results: what a profile point times, `executor.execute`), and

    groups      its requests, [count, query tokens, context, is_prompt] (+ drafts
                verified, where a request verifies any): a profile point's groups,
                equal requests run together, sorted
    schedule_s  host seconds the engine spent scheduling it, and
    process_s   applying its results: a profile's host sample (the simulator writes
                its cost model's host price as schedule_s)
    overlapped  it was launched while the step before it ran (async scheduling), so its
                duration is a pipelined step's, the host's work hidden behind the device's
    device_s    (only where the executor times its device: the torch executor on CUDA)
                the device's span of the step's work, from CUDA events around its
                launch: unlike `duration`, it holds none of the host's work around the
                step (under async scheduling a step's results are read after the next
                step's launch, whose host work can then land in its duration). Absent
                on the CPU and in a simulated log, whose durations are the steps' own.
                The events are read without a synchronisation once the device has passed
                them: at once if it has when the step is applied, else when the next step
                is applied, or when the engine has nothing in flight (`flush`), or at
                `close`. Fits read it for pipelined steps only (`LoggedStep.seconds`).
    launch_s    (where the executor times its device) the host's seconds inside its launch
                (`executor.execute_async`): what a profile point's `launch_s` measures.
                A step whose launch outlasts its device work is bound by the launch.

A line that is not what it should be is an error naming the file and the line.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any, NamedTuple

from deepinfer.config import EngineConfig
from deepinfer.executor import StepHandle
from deepinfer.outputs import SchedulerOutput
from deepinfer.records import StepRecord

FORMAT = "deepinfer-step-log"
VERSION = 1
_RECORD_FIELDS = tuple(f.name for f in fields(StepRecord))
# What every step line must hold: the StepRecord fields without a default, and these.
_REQUIRED = tuple(f.name for f in fields(StepRecord) if f.default is MISSING) + (
    "groups", "schedule_s", "process_s", "overlapped",
)  # fmt: skip


def step_groups(out: SchedulerOutput) -> list[list[int | bool]]:
    """`out`'s requests as a profile point's groups: [count, query, context, is_prompt],
    plus the drafts each verifies where it verifies any; equal requests counted once,
    in sorted order (a step's price does not depend on its requests' order)."""
    shapes = sorted(
        (r.num_tokens, r.num_computed_tokens, r.is_prompt, len(r.draft_token_ids))
        for r in out.scheduled
    )
    groups: list[list[int | bool]] = []
    last = None
    for shape in shapes:
        if shape == last:
            groups[-1][0] = int(groups[-1][0]) + 1
            continue
        q, ctx, is_prompt, drafts = shape
        groups.append([1, q, ctx, is_prompt, drafts] if drafts else [1, q, ctx, is_prompt])
        last = shape
    return groups


def step_log_header(
    model: str, hardware: str, engine: EngineConfig, executor: str, meta: dict[str, Any]
) -> dict[str, Any]:
    """The header line: `model` as the simulator loads it (a preset name or a config
    path), `hardware` its preset name, `engine` the options the run had."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": model,
        "hardware": hardware,
        "executor": executor,
        "engine": engine.to_dict() | {"async_scheduling": engine.async_scheduling},
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "meta": meta,
    }


class StepLogWriter:
    """Writes a run's steps to `path` as they are applied (one line each, flushed, so a
    server stopped any way leaves whole lines). The engine calls `scheduled` and
    `applied`; host_price: the simulator's, which prices a step's host time (its cost
    model's `cpu_time`) where the real engine measures it."""

    def __init__(
        self,
        path: str | Path,
        header: dict[str, Any],
        host_price: Callable[[SchedulerOutput], float] | None = None,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = self.path.open("w", buffering=1)
        self._file.write(json.dumps(header) + "\n")
        self._host_price = host_price
        self._schedule_s: dict[int, float] = {}  # step id -> its scheduling seconds
        self._launch_s: dict[int, float] = {}  # step id -> the host's seconds in its launch
        # The last applied step's line and handle, while its device time is not read.
        self._pending: tuple[dict[str, Any], StepHandle] | None = None
        self.num_steps = 0

    def scheduled(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine scheduled `out` in `seconds` (an empty step is never applied)."""
        if out.scheduled:
            self._schedule_s[out.step_id] = seconds

    def launched(self, out: SchedulerOutput, seconds: float) -> None:
        """The executor's launch of `out` returned after `seconds` of the host's time."""
        self._launch_s[out.step_id] = seconds

    def applied(
        self,
        out: SchedulerOutput,
        record: StepRecord,
        seconds: float,
        overlapped: bool,
        handle: StepHandle | None = None,
    ) -> None:
        """The engine applied `out`'s results in `seconds`; `record` is its StepRecord;
        `handle` its launch: where that times the device, the line carries the step's
        device span, and waits for it if the device has not passed the step yet (written
        when the next step is applied, at `flush` or at `close`)."""
        schedule_s = self._schedule_s.pop(out.step_id, 0.0)
        launch_s = self._launch_s.pop(out.step_id, None)
        for kept in (self._schedule_s, self._launch_s):
            for step_id in [i for i in kept if i < out.step_id]:  # failed steps
                del kept[step_id]
        process_s = seconds
        if self._host_price is not None:
            schedule_s, process_s = self._host_price(out), 0.0
        line = asdict(record) | {
            "groups": step_groups(out),
            "schedule_s": schedule_s,
            "process_s": process_s,
            "overlapped": overlapped,
        }
        self._write_pending(wait=False)
        if handle is not None and handle.times_device:
            if launch_s is not None:  # (a launch's host time means something beside a device's)
                line["launch_s"] = launch_s
            self._pending = (line, handle)
            self._write_pending(wait=False, only_if_passed=True)
        else:
            self._write(line)

    def flush(self) -> None:
        """Write the step waiting for its device span, waiting for the device: the engine
        calls it when it has nothing in flight, so an idle or stopped engine's last step
        is on disk (the device is then at most that step's last kernels away)."""
        self._write_pending(wait=True)

    def _write_pending(self, wait: bool, only_if_passed: bool = False) -> None:
        """The step waiting for its device span, with it where the device has passed the
        step (a step later, it has: the stream runs the steps in order) or `wait`;
        only_if_passed: leave it waiting while the device has not passed it."""
        if self._pending is None:
            return
        line, handle = self._pending
        try:
            device = handle.device_seconds(wait)
        except Exception:  # a device that failed (a step's fault): the line without it
            device = None
        if device is None and only_if_passed:
            return
        self._pending = None
        self._write(line if device is None else line | {"device_s": device})

    def _write(self, line: dict[str, Any]) -> None:
        self._file.write(json.dumps(line) + "\n")
        self.num_steps += 1

    def close(self) -> None:
        if not self._file.closed:
            try:
                self._write_pending(wait=True)  # (the run is over: waiting costs it nothing)
            finally:
                self._file.close()

    def __enter__(self) -> StepLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LoggedStep(NamedTuple):
    """One step read back from a step log file."""

    line: int  # its line in the file (1: the header)
    record: StepRecord
    groups: list[list[Any]]
    schedule_s: float
    process_s: float
    overlapped: bool
    device_s: float | None = None  # the device's span of its work, where the run timed it
    launch_s: float | None = None  # the host's seconds inside its launch, likewise

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.process_s

    @property
    def seconds(self) -> float:
        """The step's own time, as a profile point times it: a pipelined step's device
        span where the log has one (its duration can hold host work of the next step's
        launch), else its duration (a step run alone: the executor's time, host work
        included, as `executor.execute` is timed for a profile point)."""
        if self.device_s is None or not self.overlapped:
            return self.record.duration
        return self.device_s


@dataclass
class StepLogFile:
    """A step log file read back: its header and its steps in order."""

    path: Path
    header: dict[str, Any]
    steps: list[LoggedStep]

    @property
    def engine(self) -> dict[str, Any]:
        return dict(self.header["engine"])


def read_step_log(path: str | Path) -> StepLogFile:
    """Read a step log file; ValueError naming the file and line of anything malformed.
    A last line cut short (a run killed while writing it) is left out."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the step log ({e.strerror or e})") from None
    lines = text.split("\n")
    cut = lines[-1] != ""  # no newline after the last line: it may be incomplete
    if not lines[0].strip():
        raise ValueError(f"{path}:1: empty: not a deepinfer step log")
    header = _header(path, lines[0])
    steps = []
    for n, raw in enumerate(lines[1:], start=2):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            if cut and n == len(lines):
                break
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        steps.append(_step(path, n, obj))
    return StepLogFile(path, header, steps)


def _header(path: Path, raw: str) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:1: not JSON ({e.msg}): not a deepinfer step log") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(
            f"{path}:1: not a deepinfer step log (its first line must be a header with "
            f'"format": "{FORMAT}"; `--step-log PATH` of a real or simulated run writes one)'
        )
    if header.get("version") != VERSION:
        raise ValueError(
            f"{path}:1: step log version {header.get('version')!r}; this deepinfer reads "
            f"version {VERSION}"
        )
    for key, kind in (("model", str), ("hardware", str), ("engine", dict), ("meta", dict)):
        if not isinstance(header.get(key), kind):
            raise ValueError(f"{path}:1: the header's {key!r} is missing or not a {kind.__name__}")
    return header


def _step(path: Path, n: int, obj: Any) -> LoggedStep:
    where = f"{path}:{n}"
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a step must be a JSON object")
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"{where}: the step has no {', '.join(map(repr, missing))}")
    for key in ("duration", "schedule_s", "process_s", "device_s", "launch_s"):
        if key not in obj:  # (device_s and launch_s only: the others are required)
            continue
        value = obj[key]
        if not _is_count(value, float):
            raise ValueError(f"{where}: {key} {value!r}: must be a finite number of seconds >= 0")
    for f in fields(StepRecord):  # counts are whole; every figure a finite number >= 0
        value = obj.get(f.name)
        kind = float if f.type in ("float", float) else int
        given = f.name in obj and not (value is None and f.default is None)
        if given and not _is_count(value, kind):
            raise ValueError(f"{where}: {f.name} {value!r}: must be a number >= 0")
    if not isinstance(obj["overlapped"], bool):
        raise ValueError(f"{where}: overlapped {obj['overlapped']!r}: must be true or false")
    groups = obj["groups"]
    if not isinstance(groups, list) or not groups:
        raise ValueError(f"{where}: groups {groups!r}: must list the step's requests")
    for g in groups:
        if not _is_group(g):
            raise ValueError(
                f"{where}: group {g!r}: must be [count, query tokens, context, is_prompt] "
                "(+ drafts verified), count and query >= 1"
            )
    record = StepRecord(**{k: obj[k] for k in _RECORD_FIELDS if k in obj})
    device, launch = obj.get("device_s"), obj.get("launch_s")
    return LoggedStep(
        n, record, groups, float(obj["schedule_s"]), float(obj["process_s"]),
        bool(obj["overlapped"]), None if device is None else float(device),
        None if launch is None else float(launch),
    )  # fmt: skip


def _is_count(value: Any, kind: type) -> bool:
    """A number >= 0 (not a bool); for int, whole; for float, finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind is int and not isinstance(value, int):
        return False
    return math.isfinite(value) and value >= 0 if isinstance(value, float) else value >= 0


def _is_group(g: Any) -> bool:
    if not isinstance(g, list) or len(g) not in (4, 5) or not isinstance(g[3], bool):
        return False
    ints = [g[0], g[1], g[2], *g[4:]]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
        return False
    return g[0] >= 1 and g[1] >= 1 and g[2] >= 0 and all(v >= 0 for v in g[4:])
