"""A data-parallel rank's side: apply the front-end's commands to its own EngineCore.

`round_begin` / `round_end` bracket every step (expert parallelism uses them to keep
every rank in lock-step through the MoE layers, also a rank with nothing to run). A
step that raises is reported back, after `round_end`, never left half-way: the other
ranks would otherwise wait in a collective forever.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

from deepinfer.data_parallel.protocol import RankClient, StepCommand, StepReply, Stop
from deepinfer.data_parallel.request_sync import DeltaTracker
from deepinfer.engine import EngineCore
from deepinfer.request import Request
from deepinfer.routing.instance_report import instance_load


def run_command(
    rank: int,
    engine: EngineCore,
    cmd: StepCommand,
    tracker: DeltaTracker,
    round_begin: Callable[[], None] | None = None,
    round_end: Callable[[], None] | None = None,
) -> StepReply:
    """One command: adds, finishes, one engine step (when there is work), the reply."""
    changed: list[Request] = []
    engine.scheduler.kv.pool.track_cache_changes()  # (from the first command on)
    for req in cmd.adds:
        if engine.add_request(req) is not None:
            changed.append(req)  # rejected at once: the front-end learns it now
    for req_id, reason in cmd.finishes:
        engine.finish(req_id, reason)
    error: BaseException | None = None
    text = ""
    if round_begin is not None:
        round_begin()
    try:
        if engine.has_unfinished():
            changed += engine.step()
    except Exception as exc:
        error, text = exc, traceback.format_exc()
    finally:
        if round_end is not None:
            round_end()
    deltas = [tracker.delta(req) for req in changed]
    changes = engine.scheduler.kv.pool.drain_cache_changes()
    return StepReply(rank, deltas, instance_load(engine), changes, error, text)


def serve(
    rank: int,
    engine: EngineCore,
    conn: RankClient,
    round_begin: Callable[[], None] | None = None,
    round_end: Callable[[], None] | None = None,
) -> None:
    """Answer commands until Stop."""
    tracker = DeltaTracker()
    while True:
        cmd = conn.recv()
        if isinstance(cmd, Stop):
            return
        reply = run_command(rank, engine, cmd, tracker, round_begin, round_end)
        try:
            conn.send(reply)
        except Exception:  # an error that does not pickle: send its text only
            reply.error = RuntimeError(f"{type(reply.error).__name__}: {reply.error}")
            conn.send(reply)
