"""The body of one data-parallel rank process: join the group (expert parallelism),
build this rank's TorchExecutor and EngineCore, then serve the front-end's commands
(deepinfer.data_parallel.rank_loop) until told to stop."""

from __future__ import annotations

import traceback
from typing import Any

import torch

from deepinfer.config import EngineConfig
from deepinfer.data_parallel.protocol import RankClient, RankInfo
from deepinfer.data_parallel.rank_loop import serve
from deepinfer.engine import EngineCore
from executors.distributed.process_group import init_group, leave_group


def rank_device(rank: int, device: str | None) -> torch.device:
    """Rank r runs on cuda:r (or the CPU); an explicit GPU index is refused: it would put
    every rank on one GPU."""
    if device is None:
        return torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        raise ValueError(
            f"device={device!r} with data parallelism: rank r takes cuda:r; pass device='cuda'"
        )
    return torch.device("cuda", rank) if dev.type == "cuda" else dev


def rank_main(
    rank: int,
    config: EngineConfig,
    model: str,
    executor_kwargs: dict[str, Any],
    init_method: str,
    conn: RankClient,
    check_invariants: bool,
) -> None:
    """Spawned once per rank. Start-up errors go back to the launcher as text."""
    try:
        device = rank_device(rank, executor_kwargs.pop("device", None))
        if device.type == "cuda":  # Triton launches on the current device
            torch.cuda.set_device(device)
        if config.enable_expert_parallel:
            init_group(rank, config.data_parallel_size, device, init_method)
        from executors.torch_executor import TorchExecutor

        executor = TorchExecutor(config, model, device=str(device), dp_rank=rank, **executor_kwargs)
        engine = EngineCore(
            config, executor, model_max_len=executor.max_model_len,
            check_invariants=check_invariants,
        )  # fmt: skip
        conn.send(
            RankInfo(
                rank,
                engine.max_model_len,
                executor.num_kv_blocks(),
                config.block_size,
                engine.scheduler.max_prompt_tokens,
                executor.model_dir,
                executor.vocab_size,
                executor.eos_token_id,
            )  # fmt: skip
        )
    except Exception as exc:
        conn.send(RuntimeError(f"rank {rank} failed to start: {exc}\n{traceback.format_exc()}"))
        leave_group()
        return
    ep = executor.expert_parallel
    try:
        if ep is None:
            serve(rank, engine, conn)
        else:
            serve(rank, engine, conn, ep.begin_round, _no_grad(ep.end_round))
    finally:
        executor.shutdown()
        leave_group()


def _no_grad(fn: Any) -> Any:
    def run() -> None:
        with torch.inference_mode():
            fn()

    return run
