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
forward per rank: whatever a rank did not run (no work, or a step that failed before
or inside the model) `end_round` completes with empty inputs, so the others never wait.
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
    # The model's MoE layers in order (executors.models.moe.shard_experts fills it).
    layers: list[LockstepLayer] = field(default_factory=list)
    calls: int = 0  # MoE layer forwards run so far
    _round_start: int | None = None

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

    def begin_round(self) -> None:
        """Start of a step in which every rank runs (or pads) exactly one forward."""
        self._round_start = self.calls

    def end_round(self) -> None:
        """Run the MoE layers this rank did not reach this round with no tokens of its own
        (it still computes and returns the other ranks' rows for its experts)."""
        if self._round_start is None:
            raise RuntimeError("ExpertParallel.end_round without begin_round")
        target = self._round_start + len(self.layers)
        self._round_start = None
        if self.calls > target:
            raise RuntimeError(
                f"expert-parallel lock-step broken: {self.calls - target + len(self.layers)} "
                f"MoE layer calls in one round, expected {len(self.layers)} (one forward)"
            )
        while self.calls < target:
            self.layers[self.calls % len(self.layers)].idle()
