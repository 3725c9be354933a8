"""Launch the data-parallel ranks of `LLM(..., data_parallel_size=N)`: one process per
rank (torch.multiprocessing, spawn), a pipe to each, a TCP rendezvous for the
torch.distributed group when experts are sharded (gloo on the CPU, NCCL on CUDA)."""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch.multiprocessing as mp

from deepinfer.config import EngineConfig
from deepinfer.data_parallel.front_end import DataParallelEngine
from deepinfer.data_parallel.protocol import RankInfo
from executors.distributed.expert_parallel import check_expert_split
from executors.distributed.process_group import free_port
from executors.distributed.rank_worker import rank_main
from executors.host_kv_tier import check_host_tier
from executors.loader import read_model_config, resolve_model_dir


def launch_data_parallel(
    config: EngineConfig,
    model: str,
    *,
    check_invariants: bool = False,
    start_timeout_s: float = 1800.0,
    **executor_kwargs: Any,
) -> DataParallelEngine:
    """Start `config.data_parallel_size` ranks and return the front-end over them; a rank
    that fails to start is an error carrying its traceback (the others are stopped)."""
    # The model is found (or refused: a missing folder, a revision of a local model) and
    # fetched here, once, before any process starts.
    model_dir = resolve_model_dir(
        model,
        revision=executor_kwargs.get("revision"),
        weights=executor_kwargs.get("load_format", "auto") != "dummy",
    )
    check_host_tier(config)  # refused here, before any process starts
    if config.enable_expert_parallel:  # refused here, before any process starts
        cfg = read_model_config(model_dir)
        if not cfg.n_routed_experts:
            raise ValueError(f"enable_expert_parallel: {cfg.name} has no routed experts to shard")
        check_expert_split(cfg.n_routed_experts, config.data_parallel_size)
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs, conns = [], []
    for rank in range(config.data_parallel_size):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=rank_main,
            args=(rank, config, model, dict(executor_kwargs), init_method, child, check_invariants),
            name=f"deepinfer-dp-rank{rank}",
            daemon=True,
        )
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    try:
        infos = [_await_info(r, conns[r], procs[r], start_timeout_s) for r in range(len(procs))]
    except BaseException:
        _stop(procs)
        raise
    engine = DataParallelEngine(conns, infos, router=config.data_parallel_router, seed=config.seed)
    weakref.finalize(engine, _stop, procs)
    engine.on_shutdown = lambda: _join(procs)
    return engine


def _await_info(rank: int, conn: Any, proc: Any, timeout_s: float) -> RankInfo:
    deadline = time.monotonic() + timeout_s
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"data-parallel rank {rank} exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"data-parallel rank {rank} did not start in {timeout_s:.0f} s")
    info = conn.recv()
    if isinstance(info, Exception):
        raise info
    return info


def _join(procs: list[Any], timeout_s: float = 30.0) -> None:
    for p in procs:
        p.join(timeout_s)
    _stop(procs)


def _stop(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5.0)
