"""Frozen engine configuration.

`EngineConfig` is flat: the names in docs/design.md ("Public names") work at the top level
(`EngineConfig(block_size=64, max_num_seqs=128)`), and `LLM(...)` and the CLI
accept the same names. Every field does what it says on both executors, or is
refused here with a clear error until it does.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deepinfer import envs
from deepinfer.model_config import QUANTIZATIONS


class EngineRole(enum.StrEnum):
    """What part of serving this engine does (prefill/decode disaggregation)."""

    NORMAL = "normal"  # prefill and decode
    PREFILL = "prefill"  # a request finishes after its first token
    DECODE = "decode"  # requests arrive with their prompt already in the cache


@dataclass(frozen=True)
class EngineConfig:
    """Every engine knob, validated at construction (errors name the field)."""

    block_size: int = 64
    num_gpu_blocks: int | None = None  # None: derived from device memory
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's limit, capped by the cache
    enable_chunked_prefill: bool = True
    prefill_watermark: float = field(default_factory=envs.prefill_watermark)
    enable_prefix_caching: bool = True
    role: EngineRole = EngineRole.NORMAL
    num_speculative_tokens: int = 0
    enable_mtp_varlen: bool = field(default_factory=envs.enable_mtp_varlen)
    # Step N+1 scheduled and launched while step N runs (the runner feeds N's tokens to
    # N+1 on the device). None: on, except with several data-parallel ranks, whose
    # lock-step rounds do not overlap (expert parallelism refuses it).
    async_scheduling: bool | None = None
    policy: str = "fcfs"  # "fcfs" or "priority"
    seed: int = 0
    # Attention data parallelism: this many ranks, each with its own scheduler and KV
    # cache (num_gpu_blocks, max_num_seqs and the token budget are per rank).
    data_parallel_size: int = 1
    # Which rank a new request goes to (a policy of deepinfer.routing, by name).
    data_parallel_router: str = "least-load"
    # MoE experts sharded over the data-parallel ranks (all-to-all dispatch and combine).
    enable_expert_parallel: bool = False
    # Bit-identical results per request whatever the batch, chunking or prefix hits (CUDA
    # only: the CPU executor refuses it; the simulator needs a profile measured in it).
    batch_invariant: bool = field(default_factory=envs.batch_invariant)
    # "fp8": linear weights in e4m3 with a scale per 128 x 128 block (DeepSeek's FP8
    # checkpoints; a bf16 checkpoint is quantized at load time), priced so by the
    # simulator. None: the checkpoint as it is (an FP8 checkpoint is served in FP8).
    quantization: str | None = None
    # Host DRAM for prefix blocks evicted from HBM (deepinfer/kv_cache/tiers.py), GiB per
    # engine; 0: none. The torch executor copies the blocks (executors/host_kv_tier.py),
    # the simulator prices the copies; neither with data-parallel ranks.
    kv_host_cache_gib: float = 0.0

    def __post_init__(self) -> None:
        envs.refuse_unimplemented()
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization={self.quantization!r}: expected one of {QUANTIZATIONS} or None"
            )
        if isinstance(self.role, str) and not isinstance(self.role, EngineRole):
            try:
                object.__setattr__(self, "role", EngineRole(self.role.lower()))
            except ValueError:
                raise ValueError(
                    f"role={self.role!r}: expected one of {[r.value for r in EngineRole]}"
                ) from None
        _positive("block_size", self.block_size)
        if self.num_gpu_blocks is not None:
            _positive("num_gpu_blocks", self.num_gpu_blocks)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]"
            )
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if not 0.0 < self.prefill_watermark <= 1.0:
            raise ValueError(f"prefill_watermark={self.prefill_watermark}: must be in (0, 1]")
        if self.enable_mtp_varlen and self.num_speculative_tokens == 0:
            # Variable-length drafts up to DEEPINFER_USE_NEXTN_DECODE (the reference's name).
            object.__setattr__(self, "num_speculative_tokens", envs.use_nextn_decode())
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens}: must be >= 0")
        if self.num_speculative_tokens >= self.max_num_batched_tokens:
            raise ValueError(
                "num_speculative_tokens must be smaller than max_num_batched_tokens "
                "so a verification step fits in one batch"
            )
        _positive("data_parallel_size", self.data_parallel_size)
        self._check_router()
        if self.async_scheduling is None:  # (`replace` keeps it automatic)
            object.__setattr__(self, "_async_auto", True)
            object.__setattr__(self, "async_scheduling", self.data_parallel_size == 1)
        elif not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling={self.async_scheduling!r}: expected True, False or None"
            )
        if self.enable_expert_parallel:
            self._check_expert_parallel()
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant={self.batch_invariant!r}: expected True or False")
        gib = self.kv_host_cache_gib
        if not isinstance(gib, (int, float)) or isinstance(gib, bool) or not gib >= 0:
            raise ValueError(f"kv_host_cache_gib={gib!r}: must be a number of GiB >= 0")
        if gib > 0 and not self.enable_prefix_caching:
            raise ValueError(
                f"kv_host_cache_gib={gib} with enable_prefix_caching=False: the host tier "
                "holds evicted prefix-cache blocks; turn prefix caching on or set it to 0"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy={self.policy!r}: expected 'fcfs' or 'priority'")
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_model_len > self.max_num_batched_tokens
        ):
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds max_num_batched_tokens="
                f"{self.max_num_batched_tokens} with enable_chunked_prefill=False: a prompt "
                "that long could never be scheduled; enable chunked prefill or raise the budget"
            )

    def _check_router(self) -> None:
        # The default names a router and suits one rank: only another name is looked up,
        # so that a config which does not route leaves the routing package unloaded.
        if self.data_parallel_router == "least-load":
            return
        from deepinfer.routing import ROUTERS

        if self.data_parallel_router not in ROUTERS:
            raise ValueError(
                f"data_parallel_router={self.data_parallel_router!r}: expected one of "
                f"{', '.join(ROUTERS)}"
            )
        if self.data_parallel_size == 1:
            raise ValueError(
                f"data_parallel_router={self.data_parallel_router!r} needs "
                "data_parallel_size > 1: one rank has no choice to make"
            )

    def _check_expert_parallel(self) -> None:
        """Expert parallelism runs one forward per rank per step, then as many MTP passes
        as the rank that drafts furthest, in lock-step (docs/design.md, data parallelism)."""
        if self.data_parallel_size == 1:
            raise ValueError(
                "enable_expert_parallel=True needs data_parallel_size > 1: experts are "
                "sharded over the data-parallel ranks (tensor parallelism is not built)"
            )
        if self.async_scheduling:
            raise ValueError(
                "async_scheduling=True with enable_expert_parallel: a rank may then run two "
                "forwards in one engine step, breaking the MoE lock-step; set it to False"
            )
        if self.quantization is not None:
            raise ValueError(
                f"quantization={self.quantization!r} with enable_expert_parallel: the expert "
                "exchange carries bf16 expert weights only; use one of the two"
            )
        if self.batch_invariant:
            raise ValueError(
                "batch_invariant=True with enable_expert_parallel: a token's expert outputs "
                "then depend on which ranks' tokens share the exchange, which the mode does "
                "not fix yet; use one of the two"
            )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(
        cls, values: Mapping[str, Any], *, source: str = "engine options"
    ) -> EngineConfig:
        """Build from user-supplied keys; an unknown key is an error naming it."""
        known = set(cls.field_names())
        unknown = sorted(k for k in values if k not in known)
        if unknown:
            raise ValueError(
                f"{source}: unknown engine option(s) {unknown}; known: {sorted(known)}"
            )
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready, such that `from_dict` rebuilds this config: the role
        by name, and an automatic async_scheduling as None (dataclasses.asdict writes
        the value it resolved to, which a copy would then keep for any
        data_parallel_size)."""
        d = dataclasses.asdict(self)
        d["role"] = self.role.value
        if getattr(self, "_async_auto", False):
            d["async_scheduling"] = None
        return d

    def replace(self, **changes: Any) -> EngineConfig:
        if getattr(self, "_async_auto", False) and "async_scheduling" not in changes:
            changes["async_scheduling"] = None  # decided again for the new config
        return dataclasses.replace(self, **changes)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a positive integer")
