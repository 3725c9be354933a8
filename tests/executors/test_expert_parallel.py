"""Expert-parallel MoE layers over gloo ranks (spawned processes) against one process."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from executors.distributed.expert_parallel import ExpertParallel, check_expert_split, combine
from executors.distributed.process_group import free_port
from executors.mtp_drafter import mtp_passes
from tests.executors import ep_workers
from tests.executors.tiny_models import TinyModel


def _spawn(world: int, path: str, checks: list[str], device: str = "cpu") -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    args = (world, init, path, checks, device)
    mp.spawn(ep_workers.run_checks, args=args, nprocs=world, join=True)


def test_ep_moe_over_2_ranks_equals_one_process_and_pads_idle_ranks(
    tiny_models: dict[str, TinyModel],
) -> None:
    """Grouped sigmoid top-2 (V3) with a rank that has no tokens; then rounds in which
    rank 1 runs no layer, or stops after the first, and is padded; then rounds of MTP
    passes (the MTP layer's experts sharded too) in which every rank runs the most passes
    any rank offers, a rank with no work or one that failed mid-draft padded, and a pass
    past the agreed count refused before its exchange (ep_workers). Four ranks:
    test_data_parallel_llm.py (group-limited top-3 V2 through the whole engine)."""
    checks = ["moe_outputs_equal_one_process", "idle_ranks_pad_the_round"]
    checks.append("ranks_pad_to_the_most_mtp_passes")
    _spawn(2, str(tiny_models["v3_mtp"].path), checks)


@pytest.mark.parametrize(
    ("k", "drafting", "passes"),
    [
        (3, [], 1),  # rows, none drafting (a prompt chunk that samples nothing): pass 1
        (0, [(10, 16)], 1),  # drafting asked for no drafts: pass 1 writes the MTP KV
        (3, [(10, 16)], 3),  # slots 11 and 12 held: both chained passes
        (3, [(14, 16), (7, 8)], 2),  # the furthest-reaching request: slot 15 only
        (3, [(7, 8)], 1),  # no lookahead slot (max_model_len): no chained pass
    ],
)  # fmt: skip
def test_a_drafting_step_runs_pass_1_then_the_longest_chain(
    k: int, drafting: list[tuple[int, int]], passes: int
) -> None:
    """(newest position, block-table slots) per drafting request -> the MTP layer's
    forwards, as MTPDrafter.propose's loop runs them."""
    positions, slots = [p for p, _ in drafting], [s for _, s in drafting]
    assert mtp_passes(k, True, positions, slots) == passes
    assert mtp_passes(k, False, [], []) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4, 8])
def test_ep_moe_over_nccl_equals_one_gpu(tiny_models: dict[str, TinyModel], world: int) -> None:
    """The same checks over NCCL, rank r on cuda:r, the Triton fused MoE on each rank's
    experts (float32); skipped where fewer GPUs are visible. v2_group has 8 experts."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    checks = ["moe_outputs_equal_one_process", "idle_ranks_pad_the_round"]
    _spawn(world, str(tiny_models["v2_group"].path), checks, device="cuda")


def test_experts_must_split_evenly() -> None:
    with pytest.raises(ValueError, match="8 routed experts do not split evenly over 3 ranks"):
        check_expert_split(8, 3)
    ep = ExpertParallel(rank=1, world_size=4, num_experts=8)
    assert (ep.num_local, ep.first_expert) == (2, 2)


def test_end_round_needs_begin_round() -> None:
    with pytest.raises(RuntimeError, match="without begin_round"):
        ExpertParallel(rank=0, world_size=2, num_experts=4).end_round()


def test_both_combine_orders_sum_each_tokens_k_rows() -> None:
    """The CPU (expert order) and CUDA (slot order) combines agree; shown on the CPU."""
    t, k, hidden = 5, 3, 8
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(6, generator=gen)[:k] for _ in range(t)])  # [T, k]
    order = torch.argsort(ids.reshape(-1), stable=True)
    back = torch.randn(t * k, hidden, generator=gen)  # rows in sent order
    want = torch.zeros(t, hidden)
    for row, pair in enumerate(order.tolist()):
        want[pair // k] += back[row]
    for slot_order in (False, True):
        got = combine(back, order, order // k, t, k, slot_order=slot_order)
        torch.testing.assert_close(got, want)
