"""Where points run: this process, a pool of local processes, or a Ray cluster.

All three take tasks with `submit` and hand back finished rows with `next_done`, in
whatever order they finish; the runner's result does not depend on that order. The
sweep's shared context (the trace, the SLO, the seed) reaches each worker once.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Protocol

from sim.sweep.point import PointTask, SweepContext, run_point


class Backend(Protocol):
    name: str
    workers: int

    def submit(self, task: PointTask) -> None: ...

    def next_done(self) -> dict[str, Any]:
        """A finished point's row (blocks until one is)."""
        ...

    def in_flight(self) -> int: ...

    def close(self) -> None: ...


class InlineBackend:
    """One worker: run each point here, in submission order (no process to start)."""

    name = "inline"
    workers = 1

    def __init__(self, ctx: SweepContext) -> None:
        self.ctx = ctx
        self._queue: deque[PointTask] = deque()

    def submit(self, task: PointTask) -> None:
        self._queue.append(task)

    def next_done(self) -> dict[str, Any]:
        return run_point(self._queue.popleft(), self.ctx)

    def in_flight(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        self._queue.clear()


_WORKER_CTX: SweepContext | None = None


def _init_worker(ctx: SweepContext) -> None:
    global _WORKER_CTX
    _WORKER_CTX = ctx


def _run_in_worker(task: PointTask) -> dict[str, Any]:
    assert _WORKER_CTX is not None, "worker started without its sweep context"
    return run_point(task, _WORKER_CTX)


class PoolBackend:
    """Local worker processes. A worker that dies (killed, out of memory) breaks the
    whole pool, and which of the points in flight killed it is unknown: each of them
    runs again alone in a fresh process, the one that dies alone becomes an error row,
    and the pool is rebuilt."""

    name = "local"

    def __init__(self, ctx: SweepContext, workers: int) -> None:
        self.ctx = ctx
        self.workers = workers
        # fork: workers inherit the imported simulator instead of importing it again.
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        self._mp = multiprocessing.get_context(method)
        self._pool = self._new_pool(workers)
        self._futures: dict[Future[dict[str, Any]], PointTask] = {}
        self._ready: deque[dict[str, Any]] = deque()

    def _new_pool(self, workers: int) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            workers, mp_context=self._mp, initializer=_init_worker, initargs=(self.ctx,)
        )

    def submit(self, task: PointTask) -> None:
        self._futures[self._pool.submit(_run_in_worker, task)] = task

    def next_done(self) -> dict[str, Any]:
        while not self._ready:
            done, _ = wait(list(self._futures), return_when=FIRST_COMPLETED)
            broken = False
            for fut in sorted(done, key=lambda f: _order(self._futures[f])):
                try:
                    self._ready.append(fut.result())
                    del self._futures[fut]
                except BrokenProcessPool:
                    broken = True
            if broken:
                self._recover()
        return self._ready.popleft()

    def _recover(self) -> None:
        suspects = sorted(self._futures.values(), key=_order)
        self._futures.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for task in suspects:
            with self._new_pool(1) as alone:
                try:
                    self._ready.append(alone.submit(_run_in_worker, task).result())
                except BrokenProcessPool:
                    self._ready.append(_died(task))
        self._pool = self._new_pool(self.workers)

    def in_flight(self) -> int:
        return len(self._futures) + len(self._ready)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class RayBackend:
    """Ray tasks, one CPU each: `address` "local" starts Ray here with `workers` CPUs,
    "auto" joins the running cluster (RAY_ADDRESS or the local head), else an address.
    The nodes need deepinfer installed, as the driver has it."""

    name = "ray"

    def __init__(self, ctx: SweepContext, address: str, workers: int | None) -> None:
        import logging

        import ray

        self._ray = ray
        kwargs: dict[str, Any] = {"logging_level": logging.ERROR, "log_to_driver": False}
        if address == "local":
            kwargs |= {"num_cpus": workers or os.cpu_count(), "include_dashboard": False}
        else:
            kwargs["address"] = address
        self._owns = not ray.is_initialized()  # a caller's Ray session stays up after us
        if self._owns:
            ray.init(**kwargs)
        self.workers = int(ray.cluster_resources().get("CPU", 1))
        # Inside a list, the context is not resolved per task: a worker fetches it once.
        self._ctx_ref = [ray.put(ctx)]
        self._remote = ray.remote(num_cpus=1, max_retries=1)(_ray_point)
        self._refs: dict[Any, PointTask] = {}

    def submit(self, task: PointTask) -> None:
        self._refs[self._remote.remote(task, self._ctx_ref)] = task

    def next_done(self) -> dict[str, Any]:
        ready, _ = self._ray.wait(list(self._refs), num_returns=1)
        task = self._refs.pop(ready[0])
        try:
            return self._ray.get(ready[0])
        except Exception as e:  # the worker died twice (max_retries): an error row
            return _died(task, f"ray task failed: {type(e).__name__}")

    def in_flight(self) -> int:
        return len(self._refs)

    def close(self) -> None:
        for ref in self._refs:
            self._ray.cancel(ref, force=True)
        self._refs.clear()
        if self._owns:
            self._ray.shutdown()


_RAY_CTX: dict[str, SweepContext] = {}


def _ray_point(task: PointTask, ctx_ref: list[Any]) -> dict[str, Any]:
    import ray

    key = ctx_ref[0].hex()
    if key not in _RAY_CTX:  # a worker process keeps the context of the sweep it serves
        _RAY_CTX.clear()
        _RAY_CTX[key] = ray.get(ctx_ref[0])
    return run_point(task, _RAY_CTX[key])


def make_backend(ctx: SweepContext, workers: int, ray_address: str | None) -> Backend:
    if ray_address is not None:
        return RayBackend(ctx, ray_address, workers)
    if workers <= 1:
        return InlineBackend(ctx)
    return PoolBackend(ctx, workers)


def _order(task: PointTask) -> tuple[str, float]:
    return (task.config.key, task.rate)


def _died(task: PointTask, why: str = "the worker process died (out of memory?)") -> dict:
    return {
        "config_key": task.config.key,
        "rate": task.rate,
        "status": "error",
        "meets_slo": False,
        "reason": why,
    }
