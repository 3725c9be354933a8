"""What an instance tells the router after a step, and how the router takes it in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from deepinfer.engine import EngineCore
from deepinfer.routing.instance_view import InstanceLoad, InstanceView
from deepinfer.routing.router import Router


@dataclass(frozen=True)
class InstanceReport:
    """One instance's state after a step: its load, the prefix blocks it began or ceased
    to hold since its last report (hash -> cached now), and the requests placed on it
    that ended since then."""

    index: int
    load: InstanceLoad
    cache_changes: dict[int, bool] = field(default_factory=dict)
    finished: tuple[str, ...] = ()


def instance_load(engine: EngineCore) -> InstanceLoad:
    s = engine.scheduler
    return InstanceLoad(s.num_waiting, s.num_running, s.kv.usage)


def report_of(index: int, engine: EngineCore, finished: Sequence[str] = ()) -> InstanceReport:
    """The engine's report now (drains its pool's record of cache changes)."""
    changes = engine.scheduler.kv.pool.drain_cache_changes()
    return InstanceReport(index, instance_load(engine), changes, tuple(finished))


def view_of(index: int, engine: EngineCore) -> InstanceView:
    """A fresh view of an engine (from now on its pool records its cache changes)."""
    engine.scheduler.kv.pool.track_cache_changes()
    s = engine.scheduler
    return InstanceView(index, s.block_size, s.max_prompt_tokens, instance_load(engine))


def take_report(router: Router, views: Sequence[InstanceView], report: InstanceReport) -> None:
    """The router and the instance's view take in a report."""
    view = views[report.index]
    view.load = report.load
    if report.cache_changes:
        view.apply_cache_changes(report.cache_changes)
    router.on_report(report.index, report.load)
    for req_id in report.finished:
        router.on_finished(req_id, report.index)
