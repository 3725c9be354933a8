"""DeepSeek MoE: top-k router (V2 softmax greedy / group-limited, V3 sigmoid noaux_tc),
routed experts held as fused 3-D weights, and always-on shared experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from deepinfer.model_config import ModelConfig
from executors.models.layers import GatedMLP
from kernels import ops as kernel_ops

if TYPE_CHECKING:
    from executors.distributed.expert_parallel import ExpertParallel, LockstepLayer


class Router(nn.Module):
    """Scores experts and picks top-k per token; kept in float32 like the reference."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.scoring_func = cfg.scoring_func
        self.topk_method = cfg.topk_method
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        # V2 (original DeepSeek code): a normalised top-k is not scaled afterwards.
        self.scale_after_norm = cfg.model_type != "deepseek_v2"
        self.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size))
        if self.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts))
        else:
            self.register_parameter("e_score_correction_bias", None)
        self.batch_invariant = False  # set by executors/batch_invariant.py

    def forward(self, x: torch.Tensor, num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> weights [T, top_k + S] float32, expert ids [T, top_k + S] int64
        (kernels.ops.moe_router); S = num_shared always-chosen ids E.. of weight 1."""
        return kernel_ops.moe_router(
            x, self.weight, self.e_score_correction_bias, self.top_k, self.scoring_func,
            self.topk_method, self.n_group, self.topk_group, self.norm_topk_prob,
            self.scale_after_norm, self.routed_scaling_factor,
            batch_invariant=self.batch_invariant, num_shared=num_shared,
        )  # fmt: skip


class Experts(nn.Module):
    """Routed experts as fused tensors (transformers' layout):
    gate_up_proj [E, 2 * I, hidden] (gate rows first), down_proj [E, hidden, I].
    After `to_fp8(block)` both are e4m3 with block scales beside them,
    gate_up_proj_scale_inv [E, 2 * ceil(I / bn), ceil(hidden / bk)] (the gate rows'
    blocks, then the up rows': the checkpoint's gate_proj and up_proj scales stacked) and
    down_proj_scale_inv [E, ceil(hidden / bn), ceil(I / bk)].
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.batch_invariant = False  # set by executors/batch_invariant.py
        self.fp8_block: tuple[int, int] | None = None
        self.gate_up_proj_scale_inv: nn.Parameter | None
        self.down_proj_scale_inv: nn.Parameter | None
        self.register_parameter("gate_up_proj_scale_inv", None)
        self.register_parameter("down_proj_scale_inv", None)

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Hold the experts as block-scaled e4m3 (uninitialised, on the weights' device:
        call on the meta device, before the parameters are allocated)."""
        (bn, bk), dev = block, self.gate_up_proj.device
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size

        def param(*shape: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=dev), requires_grad=False)

        self.gate_up_proj = param(e, 2 * i, h, dtype=torch.float8_e4m3fn)
        self.gate_up_proj_scale_inv = param(e, 2 * -(-i // bn), -(-h // bk))
        self.down_proj = param(e, h, i, dtype=torch.float8_e4m3fn)
        self.down_proj_scale_inv = param(e, -(-h // bn), -(-i // bk))
        self.fp8_block = block

    def fp8_scales(self) -> kernel_ops.Fp8Scales | None:
        if self.fp8_block is None:
            return None
        assert self.gate_up_proj_scale_inv is not None and self.down_proj_scale_inv is not None
        return kernel_ops.Fp8Scales(
            self.gate_up_proj_scale_inv, self.down_proj_scale_inv, self.fp8_block
        )

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x: [T, hidden], weights/ids: [T, k] -> [T, hidden] (kernels.ops.fused_moe:
        float32 accumulation over the k experts of a token; `shared` as there)."""
        return kernel_ops.fused_moe(
            x, self.gate_up_proj, self.down_proj, weights, ids,
            batch_invariant=self.batch_invariant, shared=shared, fp8=self.fp8_scales(),
        )  # fmt: skip


# Steps of at most this many tokens run the shared experts inside the fused MoE launches
# (their weights stream like a routed expert's; no GEMVs, activation or add of their own).
# Each 16-row block of the MoE kernel streams an expert's weights again, so past a few
# blocks cuBLAS runs the shared MLP cheaper; the launches saved matter most at small
# batches, and by this size they stop paying. Batch-invariant mode always fuses (one
# path whatever the batch).
SHARED_IN_MOE_MAX_TOKENS = 64


class MoE(nn.Module):
    """Router, routed experts and shared experts. With `ep` set (ExpertParallel.shard)
    `experts` holds this rank's share only and the routed part runs over all ranks."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ep: ExpertParallel | None = None
        self.gate = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        # The shared MLP is num_shared experts' worth wide (moe_intermediate_size each).
        self.num_shared = cfg.n_shared_experts
        self.shared_experts = (
            GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts > 0
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]
        shared = self._shared_in_moe(x)
        if shared is not None:
            weights, ids = self.gate(x, num_shared=self.num_shared)
            return self.experts(x, weights, ids, shared)
        if self.ep is None:
            weights, ids = self.gate(x)
            out = self.experts(x, weights, ids)
        else:
            out = self._expert_parallel(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _shared_in_moe(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate/up [2SI, hidden], down [hidden, SI]) of the shared MLP when this step runs
        it inside the fused MoE kernel (SHARED_IN_MOE_MAX_TOKENS), else None. FP8 experts
        run no shared MLP inside (the kernel takes their scales for routed experts only)."""
        mlp = self.shared_experts
        if mlp is None or mlp.gate_up is None or self.ep is not None:
            return None
        if self.experts.fp8_block is not None or mlp.gate_up_scale is not None:
            return None
        if not self.experts.batch_invariant and x.shape[0] > SHARED_IN_MOE_MAX_TOKENS:
            return None
        return mlp.gate_up, mlp.down_proj.weight

    def _expert_parallel(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden] -> [T, hidden]; T may be 0 (the rank still serves its experts)
        assert self.ep is not None
        if x.shape[0]:
            weights, ids = self.gate(x)  # [T, k] x 2
        else:  # (the router's grouping cannot reshape zero rows)
            k = self.gate.top_k
            weights = torch.empty(0, k, dtype=torch.float32, device=x.device)
            ids = torch.empty(0, k, dtype=torch.int64, device=x.device)
        return self.ep.routed(x, weights, ids, self.experts.gate_up_proj, self.experts.down_proj)

    def idle(self) -> None:
        """Join the layer's expert-parallel exchange with no tokens of this rank's own."""
        self._expert_parallel(self.experts.gate_up_proj.new_empty(0, self.experts.hidden_size))


def shard_experts(module: nn.Module, ep: ExpertParallel) -> list[LockstepLayer]:
    """Give every MoE layer of `module` (still on the meta device) only `ep`'s rank's
    experts and route its forward through `ep`; returns them in order (the loader hands
    `ep` the model's, and the MTP layer's the drafter chains)."""
    layers: list[LockstepLayer] = []
    for m in module.modules():
        if isinstance(m, MoE):
            old = m.experts
            m.experts = Experts(ep.num_local, old.hidden_size, old.intermediate_size)
            m.ep = ep
            layers.append(m)
    return layers
