"""FP8 block-scaled weights in the model: which modules hold them, and how they are filled.

DeepSeek-V3/R1 ship every linear layer of the decoder in e4m3 with a float32 scale per
128 x 128 block (`weight_scale_inv`, quantization_config.weight_block_size): the MLA
projections, the dense MLPs, the routed and shared experts and MTP's eh_proj. The
embedding, the LM head, the norms and the router gate stay in bf16 / float32. This model
follows the checkpoint: every `Linear` but the LM head (and modules the config's
`modules_to_not_convert` names) and every `Experts` block holds e4m3 weights after
`convert_to_fp8`. A bf16 checkpoint served with quantization="fp8" is quantized into the
same layout as it loads (`quantize_into`), so both run the same kernels.

One exception after loading (`finish_fp8`): kv_b_proj goes back to the compute dtype, as
DeepSeek's own inference code dequantizes it: decode multiplies by its per-head slices
W_UK and W_UV (absorbed attention), which read the weight itself, not through a GEMM.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.model_config import ModelConfig
from executors.models.layers import Linear
from executors.models.mla import MLAttention
from executors.models.moe import Experts
from kernels import ops as kernel_ops


def convert_to_fp8(model: nn.Module, cfg: ModelConfig) -> None:
    """Give the FP8 modules of `model` (still on the meta device) e4m3 weights and block
    scales in cfg.weight_block_size; parameter names stay the checkpoint's."""
    assert cfg.weight_block_size is not None
    block = cfg.weight_block_size
    for name, module in model.named_modules():
        if any(skip in name for skip in cfg.fp8_skip_modules):
            continue
        if (isinstance(module, Linear) and name != "lm_head") or isinstance(module, Experts):
            module.to_fp8(block)


def finish_fp8(model: nn.Module, dtype: torch.dtype) -> None:
    """After loading: kv_b_proj of every MLA back in `dtype` (see the module docstring)."""
    for module in model.modules():
        if isinstance(module, MLAttention):
            module.kv_b_proj.dequantize(dtype)


def quantize_into(
    weight: torch.Tensor,
    scale: torch.Tensor,
    value: torch.Tensor,
    block: tuple[int, int],
    halves: bool = False,
) -> None:
    """Fill e4m3 `weight` [..., N, K] and its block scales `scale` [..., rows, cols] with
    `value` [..., N, K] quantized (kernels.ops.quantize_blocks): each leading index
    is a matrix of its own, and with `halves` (fused experts' gate/up) so is each half of
    its rows, as DeepSeek's gate_proj and up_proj are quantized apart."""
    ws = weight.view(-1, *weight.shape[-2:])
    ss = scale.view(-1, *scale.shape[-2:])
    vs = value.reshape(-1, *value.shape[-2:])
    n, rows = ws.shape[1], ss.shape[1]
    parts = [(slice(0, n // 2), slice(0, rows // 2)), (slice(n // 2, n), slice(rows // 2, rows))]
    for w, s, v in zip(ws, ss, vs):
        for wr, sr in parts if halves else [(slice(0, n), slice(0, rows))]:
            q, sc = kernel_ops.quantize_blocks(v[wr], block)
            w[wr].copy_(q)
            s[sr].copy_(sc)
