"""Rank bodies of the KV-link tests (spawned; gloo): rank 0 a prefill engine, rank 1 a
decode engine fed by what rank 0 sends, checked on rank 1 against one colocated engine."""

from __future__ import annotations

import os

import torch

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from executors.distributed.kv_link import recv_handover, send_handover
from executors.distributed.process_group import init_group, leave_group
from executors.torch_executor import TorchExecutor

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    base = torch.randint(2, 256, (9,), generator=g).tolist()
    more = [torch.randint(2, 256, (n,), generator=g).tolist() for n in (6, 21)]
    return [base, base + more[0], more[1]]


def _engine(path: str, role: str) -> EngineCore:
    cfg = EngineConfig(block_size=4, num_gpu_blocks=32, max_num_batched_tokens=8, role=role)
    ex = TorchExecutor(cfg, path, device="cpu", dtype="float32")
    return EngineCore(cfg, ex, model_max_len=ex.max_model_len, check_invariants=True)


def _run(engine: EngineCore, reqs: list[Request]) -> None:
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()


def run(rank: int, init: str, path: str, kill_after_header: bool) -> None:
    """Rank 0 prefills every prompt and sends each request's KV (all but its last prompt
    token) to rank 1, which decodes them; with kill_after_header rank 0 dies after the
    first header, and rank 1's receive must raise instead of waiting for good."""
    init_group(rank, 2, CPU, init, timeout_s=60)
    try:
        prompts = _prompts()
        if rank == 0:
            engine = _engine(path, "prefill")
            reqs = [Request(str(i), p, GREEDY) for i, p in enumerate(prompts)]
            for r in reqs:
                engine.add_request(r)
            while engine.has_unfinished():
                for r in engine.step():
                    if not r.is_finished:
                        continue
                    kv = engine.executor.export_kv(r, r.num_prompt_tokens - 1)
                    if kill_after_header:  # a header whose tensor never follows
                        torch.distributed.send_object_list([("0", 1, 4, (), (1,), "int8")], dst=1)
                        os._exit(0)
                    send_handover(kv, dst=1)
            return
        if kill_after_header:
            try:
                recv_handover(0, CPU)
            except RuntimeError as e:
                print(f"rank 1: the link raised {type(e).__name__}: {e}")
                return
            raise AssertionError("a receive from a dead peer returned")
        decode = _engine(path, "decode")
        reqs = [Request(str(i), p, GREEDY) for i, p in enumerate(prompts)]
        for _ in prompts:  # in the order rank 0 finished them
            kv = recv_handover(0, CPU)
            req = reqs[int(kv.req_id)]
            assert decode.add_request(req) is None
            decode.executor.import_kv(kv)
        while decode.has_unfinished():
            decode.step()
        ref = [Request(str(i), p, GREEDY) for i, p in enumerate(prompts)]
        _run(_engine(path, "normal"), ref)
        assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in ref]
        assert all(r.finish_reason is not None and r.finish_reason.value == "length" for r in reqs)
        assert decode.executor.runner.kv_transfer.num_imported_tokens > 0
    finally:
        if not (kill_after_header and rank == 1):
            leave_group()
