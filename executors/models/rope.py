"""Decoupled RoPE of MLA: default and YaRN frequencies, interleaved or half-split layout.

The numbers follow transformers exactly: YaRN's inverse frequencies and its
attention factor (which scales cos and sin, hence both q_pe and k_pe), and the
softmax-scale correction `mscale(factor, mscale_all_dim) ** 2`.
"""

from __future__ import annotations

import math

import torch

from deepinfer.model_config import ModelConfig, RopeConfig


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2 when set."""
    scale = cfg.qk_head_dim**-0.5
    if cfg.rope.type != "default" and cfg.rope.mscale_all_dim:
        m = yarn_get_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def rope_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] (float32, on CPU) and the attention factor."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    if rope.type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = yarn_get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """cos/sin for given positions; computed per forward (positions of the batch only)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.dim = cfg.qk_rope_head_dim
        self.interleave = cfg.rope_interleave
        self._inv_freq_cpu, self.attention_factor = rope_frequencies(cfg.rope, self.dim)
        self._inv_freq: torch.Tensor | None = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, dim // 2] float32, attention factor folded in."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq_cpu.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]  # [T, dim // 2]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
