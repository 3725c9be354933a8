"""Expert parallelism: each rank of a torch.distributed group holds E / N routed experts.

Attention, the router and the shared experts are replicated; a MoE layer routes its
own tokens, sends each (token, expert) pair to the rank that holds the expert
(`all_to_all_single`: gloo on the CPU, NCCL on CUDA), runs the fused MoE over the rows
it received for its local experts, and sends the weighted outputs back, where every
token sums its k contributions in float32 (`combine`). Four collectives a layer (the
counts, the rows, the routing, the outputs) and one host sync for the split sizes, so
expert-parallel steps run eagerly (no CUDA graphs).

Lock-step: every rank must enter every MoE layer's collectives, also a rank with no
tokens this step (attention data parallelism). `begin_round` / `end_round` bracket one
step per rank: one forward of the model, then, when the ranks speculate, the MTP
drafter's passes, each one more MoE layer (the MTP layer's, its experts sharded like the
others). A rank's passes depend on its own requests (none, a prompt chunk that samples
nothing: pass 1 only, drafts: up to k), so after the forward every rank offers its
count and all take the largest (`agree_draft_passes`: one all-reduce, MAX); a rank with
fewer pads the rest. Whatever a rank did not run (no work, fewer passes, or a step that
failed before or inside the model) `end_round` completes with empty inputs, in the
same order (the forward's layers, the agreement, the passes), so the others never wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from kernels import ops as kernel_ops


class LockstepLayer(Protocol):
    """A MoE layer as the lock-step sees it (executors.models.moe.MoE)."""

    def idle(self) -> None:
        """Run the layer's exchange with no tokens of this rank's own."""
        ...


def all_reduce_max(value: int, device: torch.device, group: dist.ProcessGroup | None) -> int:
    """The largest `value` over the group's ranks (a collective: every rank must call it)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def check_expert_split(num_experts: int, world_size: int) -> None:
    """ValueError unless `world_size` ranks can hold an equal share of the experts."""
    if num_experts % world_size:
        raise ValueError(
            f"data_parallel_size={world_size} with enable_expert_parallel: the model's "
            f"{num_experts} routed experts do not split evenly over {world_size} ranks"
        )


def combine(
    back: torch.Tensor, order: torch.Tensor, tok: torch.Tensor, t: int, k: int, slot_order: bool
) -> torch.Tensor:
    """back: [T*k, H] weighted expert outputs in sent (expert) order, order: [T*k] the
    flat (token, slot) index of each, tok: [T*k] its token -> [T, H] float32.

    Each token sums its k rows in expert order, as the torch twin does, or with
    slot_order (CUDA, where index_add_ is atomic and its order varies) in slot order,
    as the Triton kernel's sum does: either way the result does not vary between runs."""
    if not slot_order:
        out = torch.zeros(t, back.shape[1], dtype=torch.float32, device=back.device)
        return out.index_add_(0, tok, back.float())
    per_slot = torch.empty(t * k, back.shape[1], dtype=torch.float32, device=back.device)
    per_slot[order] = back.float()
    return per_slot.view(t, k, -1).sum(dim=1)


@dataclass
class ExpertParallel:
    """This rank's share of the experts and the MoE layers it must run in lock-step."""

    rank: int
    world_size: int
    num_experts: int
    group: dist.ProcessGroup | None = None  # None: the default group
    # Where the agreement's tensor lives (NCCL needs a CUDA one).
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # The ranks draft after every step (num_speculative_tokens > 0): each round agrees on
    # its MTP passes and pads them (needs draft_layer).
    speculative: bool = False
    # The model's MoE layers in order, and the MoE of the MTP layer the drafter chains
    # (executors.loader.build_model fills both, from executors.models.moe.shard_experts).
    layers: list[LockstepLayer] = field(default_factory=list)
    draft_layer: LockstepLayer | None = None
    calls: int = 0  # MoE layer forwards run so far (the model's and the MTP layer's)
    _round_start: int | None = None
    _draft_end: int | None = None  # the round's last MoE call once its passes are agreed

    def __post_init__(self) -> None:
        check_expert_split(self.num_experts, self.world_size)

    @property
    def num_local(self) -> int:
        return self.num_experts // self.world_size

    @property
    def first_expert(self) -> int:
        return self.rank * self.num_local

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest `value` over the ranks (a collective: every rank must call it)."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    # ---- one MoE layer -------------------------------------------------------------

    def routed(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
        w2: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """x: [T, H], weights / ids: [T, k] (global expert ids), w13: [E/N, 2I, H],
        w2: [E/N, H, I] (the local experts) -> [T, H] in x.dtype."""
        if self._draft_end is not None and self.calls >= self._draft_end:
            # Raised before the exchange: entering it would leave this rank waiting on
            # ranks that ended the round (the count offered was too small).
            raise RuntimeError(
                "expert-parallel lock-step broken: an MTP pass beyond those the ranks "
                "agreed on for this round"
            )
        self.calls += 1
        t, k = ids.shape
        flat = ids.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)  # pairs by expert: by destination rank too
        sorted_ids = flat[order]
        tok = order // k  # [P] token of each sent pair
        send_counts = torch.bincount(sorted_ids // self.num_local, minlength=self.world_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send = send_counts.tolist()
        recv = recv_counts.tolist()
        # Each pair's expert id and weight travel as one float32 row (ids < 2^24).
        meta = torch.stack(
            [sorted_ids.float(), weights.reshape(-1)[order].float()], dim=1
        )  # [P, 2]
        recv_x = x.new_empty(sum(recv), x.shape[1])
        recv_meta = meta.new_empty(sum(recv), 2)
        dist.all_to_all_single(recv_x, x[tok].contiguous(), recv, send, group=self.group)
        dist.all_to_all_single(recv_meta, meta, recv, send, group=self.group)
        local_ids = recv_meta[:, :1].long() - self.first_expert  # [R, 1]
        recv_w = recv_meta[:, 1:].contiguous()  # [R, 1] (the kernel reads it flat)
        y = kernel_ops.fused_moe(recv_x, w13, w2, recv_w, local_ids)  # [R, H]
        back = x.new_empty(tok.shape[0], x.shape[1])
        dist.all_to_all_single(back, y, send, recv, group=self.group)
        return combine(back, order, tok, t, k, slot_order=back.is_cuda).to(x.dtype)

    # ---- lock-step -----------------------------------------------------------------

    @property
    def drafts_in_lockstep(self) -> bool:
        """Whether rounds run MTP passes that exchange tokens (a MoE MTP layer drafts)."""
        return self.speculative and self.draft_layer is not None

    def begin_round(self) -> None:
        """Start of a step in which every rank runs (or pads) exactly one forward, then
        the round's MTP passes."""
        self._round_start = self.calls
        self._draft_end = None

    def agree_draft_passes(self, passes: int) -> int:
        """After this rank's forward, before its first MTP pass: every rank offers the
        MTP passes it will run this step and the round runs the largest (a collective:
        every rank calls it once a step, `end_round` for a rank that did not). Outside a
        round (a warm-up or memory profile, the same step on every rank) it agrees only."""
        if not self.drafts_in_lockstep:
            return passes
        if self._round_start is not None:
            if self._draft_end is not None:
                raise RuntimeError("expert-parallel lock-step broken: MTP passes agreed twice")
            ran = self.calls - self._round_start
            if ran != len(self.layers):
                raise RuntimeError(
                    f"expert-parallel lock-step broken: MTP passes agreed after {ran} MoE "
                    f"layer calls, expected {len(self.layers)} (one forward)"
                )
        most = all_reduce_max(passes, self.device, self.group)
        if self._round_start is not None:
            self._draft_end = self.calls + most
        return most

    def end_round(self) -> None:
        """Run what this rank did not reach this round with no tokens of its own (it still
        computes and returns the other ranks' rows for its experts): the forward's MoE
        layers, the agreement on MTP passes (offering none), the passes up to the
        agreed count."""
        if self._round_start is None:
            raise RuntimeError("ExpertParallel.end_round without begin_round")
        start = self._round_start
        target = start + len(self.layers)
        if self._draft_end is None:
            if self.calls > target:
                self._round_start = None
                raise RuntimeError(
                    f"expert-parallel lock-step broken: {self.calls - target + len(self.layers)}"
                    f" MoE layer calls in one round, expected {len(self.layers)} (one forward)"
                )
            while self.calls < target:  # (the layer the other ranks are in: the same one)
                self.layers[self.calls - start].idle()
            self.agree_draft_passes(0)
        self._round_start = None
        end, self._draft_end = self._draft_end, None
        if end is not None:  # (None: the ranks do not draft in lock-step)
            assert self.draft_layer is not None
            while self.calls < end:
                self.draft_layer.idle()
