"""Rank bodies of the expert-parallel tests (spawned; each asserts on its own rank)."""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.model_config import ModelConfig
from executors.distributed.expert_parallel import ExpertParallel
from executors.distributed.process_group import init_group, leave_group
from executors.loader import load_model, read_hf_config
from executors.models.moe import MoE

CPU = torch.device("cpu")
TOKENS = [7, 0, 3, 1]  # tokens of each rank's step: rank 1 has none (it still takes part)


def run_checks(
    rank: int, world: int, init: str, path: str, checks: list[str], device: str = "cpu"
) -> None:
    """Join the group (gloo; NCCL with device="cuda": rank r on cuda:r), load the
    one-process and the sharded model, run `checks` in order. A check gets the
    one-process model's MoE layers (the MTP layer's last, where the model has one) and
    this rank's ExpertParallel (speculative: its rounds agree on MTP passes)."""
    dev = torch.device("cuda", rank) if device == "cuda" else CPU
    init_group(rank, world, dev, init)
    try:
        cfg = ModelConfig.from_dict(read_hf_config(Path(path)))
        full = load_model(Path(path), cfg, dtype=torch.float32, device=dev)
        ep = ExpertParallel(rank, world, cfg.n_routed_experts, device=dev, speculative=True)
        sharded = load_model(Path(path), cfg, dtype=torch.float32, device=dev, ep=ep)
        moe = [layer.mlp for layer in full.model.layers if isinstance(layer.mlp, MoE)]
        assert ep.layers == [m.mlp for m in sharded.model.layers if isinstance(m.mlp, MoE)]
        assert ep.layers[0].experts.gate_up_proj.shape[0] == cfg.n_routed_experts // world
        if full.mtp is not None:  # the drafter's MTP layer: its experts sharded too
            assert sharded.mtp is not None and ep.draft_layer is sharded.mtp.drafting_mlp()
            moe.append(full.mtp.drafting_mlp())
            assert ep.draft_layer.experts.gate_up_proj.shape[0] == cfg.n_routed_experts // world
        for name in checks:
            CHECKS[name](rank, moe, ep)
    finally:
        leave_group()


def moe_outputs_equal_one_process(rank: int, full: list[MoE], ep: ExpertParallel) -> None:
    """Every MoE layer over the ranks gives each rank's tokens what one process gives."""
    calls = ep.calls
    gen = torch.Generator().manual_seed(rank)
    hidden = full[0].experts.hidden_size
    for ref, layer in zip(full, ep.layers):  # (zip: the main layers, then it stops)
        x = torch.randn(TOKENS[rank % len(TOKENS)], hidden, generator=gen).to(
            ref.experts.gate_up_proj.device
        )
        with torch.inference_mode():  # (one process never runs a MoE on no tokens)
            want, got = ref(x) if len(x) else torch.zeros_like(x), layer(x)
        assert got.shape == want.shape == (TOKENS[rank % len(TOKENS)], hidden)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert ep.calls == calls + len(ep.layers)


def idle_ranks_pad_the_round(rank: int, full: list[MoE], ep: ExpertParallel) -> None:
    """Rank 0 runs every MoE layer; the others run none in the first round (no work) and
    only the first layer in the second (a step that failed mid-forward): end_round pads
    what they did not reach and rank 0's outputs are what one process gives."""
    calls = ep.calls
    gen = torch.Generator().manual_seed(10 + rank)
    hidden = full[0].experts.hidden_size
    for step in range(2):
        reached = len(ep.layers) if rank == 0 else step
        ep.begin_round()
        for ref, layer in list(zip(full, ep.layers))[:reached]:
            x = torch.randn(TOKENS[rank % len(TOKENS)] or 2, hidden, generator=gen)
            x = x.to(ref.experts.gate_up_proj.device)
            with torch.inference_mode():
                torch.testing.assert_close(layer(x), ref(x), rtol=1e-5, atol=1e-6)
        with torch.inference_mode():
            ep.end_round()
    assert ep.calls == calls + 2 * len(ep.layers)


def _pass(ref: MoE, layer: MoE, gen: torch.Generator, rows: int) -> None:
    """One MoE call of `rows` tokens of this rank's own, checked against one process."""
    x = torch.randn(rows, ref.experts.hidden_size, generator=gen)
    x = x.to(ref.experts.gate_up_proj.device)
    with torch.inference_mode():
        want = ref(x) if rows else torch.zeros_like(x)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)


# Rounds of MTP passes: what each rank offers (by rank % 2) and how many it runs.
ROUNDS = [
    ([3, 0], [3, 0]),  # rank 1 has no work: end_round runs its forward's layers and pads
    ([0, 2], [0, 2]),  # rank 0 then: its padded layers are the ones rank 1 is in
    ([1, 2], [1, 2]),  # both draft, to different depths
    ([2, 2], [1, 2]),  # rank 0's step fails after one pass: end_round pads the second
]


def ranks_pad_to_the_most_mtp_passes(rank: int, full: list[MoE], ep: ExpertParallel) -> None:
    """Rounds with MTP passes (`full`'s last layer is the one-process MTP MoE): every
    rank runs the most passes any rank offers (ROUNDS), each pass's rows right for the
    ranks that sent some; then a pass beyond the agreed count is refused before its
    exchange, on every rank, so none waits."""
    assert ep.draft_layer is not None and isinstance(ep.draft_layer, MoE)
    main, draft = full[:-1], full[-1]
    gen = torch.Generator().manual_seed(20 + rank)
    runs = [([o[r % 2] for r in range(ep.world_size)], n[rank % 2]) for o, n in ROUNDS]
    for offered, ran in runs:
        start = ep.calls
        ep.begin_round()
        if offered[rank]:  # a rank with work: its forward, the agreement, its passes
            for ref, layer in zip(main, ep.layers):
                _pass(ref, layer, gen, 3 + rank)  # type: ignore[arg-type]
            assert ep.agree_draft_passes(offered[rank]) == max(offered)
            for j in range(ran):
                _pass(draft, ep.draft_layer, gen, 2 if j else 5)
        with torch.inference_mode():
            ep.end_round()
        assert ep.calls == start + len(ep.layers) + max(offered)
    ep.begin_round()
    for ref, layer in zip(main, ep.layers):
        _pass(ref, layer, gen, 1)  # type: ignore[arg-type]
    assert ep.agree_draft_passes(1) == 1
    _pass(draft, ep.draft_layer, gen, 1)
    try:
        _pass(draft, ep.draft_layer, gen, 1)
    except RuntimeError as e:
        assert "beyond those the ranks agreed on" in str(e)
    else:
        raise AssertionError("a pass beyond the agreed count ran")
    with torch.inference_mode():
        ep.end_round()


CHECKS = {
    f.__name__: f
    for f in (
        moe_outputs_equal_one_process,
        idle_ranks_pad_the_round,
        ranks_pad_to_the_most_mtp_passes,
    )
}
