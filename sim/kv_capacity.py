"""How many KV-cache blocks fit on one GPU next to the weights.

Mirrors how a vLLM-style engine sizes its cache: a `gpu_memory_utilization`
share of device memory, minus the weights, minus the peak activation memory
of a profiling forward pass, divided by the bytes of one block.
"""

from __future__ import annotations

from deepinfer.config import EngineConfig
from deepinfer.kv_cache.host_cache import host_kv_blocks
from deepinfer.model_config import ModelConfig
from sim.hardware import HardwareSpec

# CUDA context, cuBLAS/NCCL workspaces and captured CUDA graphs: memory the
# engine holds outside weights and per-token activations.
FIXED_RESERVE_BYTES = 2 * 1024**3
# Peak bytes per logit (rows x vocabulary) while the sampler draws with temperature,
# top-p, top-k, min-p and logprobs: the bf16 head output and its float32 copy, then the
# filters' copies, the sort, the race's draws and the log-softmax (from the process's
# peak RSS around `sample_on_device` on the CPU), plus the float32 logits of the step
# before, which under async scheduling (the default) its pending result holds meanwhile.
SAMPLER_PEAK_BYTES_PER_LOGIT = 38


def engine_kv_blocks(
    spec: ModelConfig, hw: HardwareSpec, engine: EngineConfig, *, check_fit: bool = True
) -> int:
    """The KV blocks (per rank) of an engine of `spec` on `hw`, as the torch executor sizes
    its cache: `engine.num_gpu_blocks` when given (checked against the GPU's memory unless
    `check_fit` is False: the unit cost model prices no hardware, so any cache is a test
    case), else from memory minus weights and the activations' reserve (on a CPU: the
    host's rule, `host_kv_blocks`)."""
    num_blocks = engine.num_gpu_blocks
    speculative = engine.num_speculative_tokens > 0
    ep_size = engine.data_parallel_size if engine.enable_expert_parallel else 1
    if num_blocks is None and hw.runs_on_host:  # as the torch executor on a CPU sizes it
        per_token = kv_bytes_per_token(spec, speculative=speculative)
        max_len = engine.max_model_len or spec.max_position_embeddings
        return host_kv_blocks(max_len, engine.block_size, engine.block_size * per_token)
    if num_blocks is None:  # per rank: with expert parallelism it holds 1/N of the experts
        # The activations' reserve follows the engine's budgets, as the torch executor's
        # memory profile (a forward over its whole token budget, then the sampler over a
        # step's logits) measures it.
        reserve = default_activation_reserve_bytes(
            spec, engine.max_num_batched_tokens, engine.max_num_seqs,
            engine.num_speculative_tokens,
        )  # fmt: skip
        return kv_capacity_blocks(
            spec, hw, engine.block_size, engine.gpu_memory_utilization, reserve,
            speculative=speculative, expert_parallel_size=ep_size,
        )  # fmt: skip
    if check_fit and not hw.runs_on_host:  # (a CPU executor checks no memory either)
        check_blocks_fit(
            spec, hw, num_blocks, engine.block_size, engine.gpu_memory_utilization,
            speculative=speculative, expert_parallel_size=ep_size,
        )  # fmt: skip
    return num_blocks


def default_activation_reserve_bytes(
    model: ModelConfig,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    num_speculative_tokens: int = 0,
) -> int:
    """Peak non-weight, non-KV memory of the torch executor's memory profile at the given
    budgets (by default the engine's defaults; the simulator passes its engine's).

    The profile runs a forward over the whole token budget, then the sampler over a
    step's logits (`TorchExecutor._profile_sampler`); the peak is the larger of the two.
    Per batched token the forward's largest live tensors are the hidden states, the
    per-head q/k/v of prefill attention and the routed copies' expert intermediates;
    the sampler's rows are every request and its drafts (at most the token budget).
    """
    m = model
    per_token = (
        4 * m.hidden_size
        + 2 * m.num_attention_heads * (m.qk_head_dim + m.v_head_dim)
        + 3 * max(m.num_experts_per_tok * m.moe_intermediate_size, m.intermediate_size)
    ) * 2  # bf16
    rows = min(max_num_seqs * (1 + num_speculative_tokens), max_num_batched_tokens)
    sampler = rows * m.vocab_size * SAMPLER_PEAK_BYTES_PER_LOGIT
    return FIXED_RESERVE_BYTES + max(max_num_batched_tokens * per_token, sampler)


def kv_capacity_blocks(
    model: ModelConfig,
    hardware: HardwareSpec,
    block_size: int,
    gpu_memory_utilization: float,
    activation_reserve_bytes: int | None = None,
    speculative: bool = False,
    expert_parallel_size: int = 1,
) -> int:
    """KV blocks of `block_size` tokens that fit on one `hardware` GPU.

    (memory * utilization - weights - activation reserve) // (block_size * KV bytes per token).
    speculative: the MTP layer's weights and its KV (one more layer per block) count too,
    as in the torch executor. expert_parallel_size: the GPU holds 1/N of the routed experts.
    Raises ValueError, naming both sizes, when the weights (or weights plus
    reserve) leave no room for a single block.
    """
    if block_size <= 0:
        raise ValueError(f"block_size={block_size}: expected a positive number of tokens")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}: expected (0, 1]")
    if activation_reserve_bytes is None:
        activation_reserve_bytes = default_activation_reserve_bytes(model)
    budget = int(hardware.memory_bytes * gpu_memory_utilization)
    weights = rank_weight_bytes(model, expert_parallel_size)
    weights += mtp_own_weight_bytes(model, expert_parallel_size) if speculative else 0
    dtype = {1: "fp8", 2: "bf16", 4: "fp32"}.get(model.dtype_bytes, f"{model.dtype_bytes}-byte")
    gb = 1e9
    if weights >= budget:
        held = f" holding 1/{expert_parallel_size} of its routed experts"
        shard = "more expert-parallel ranks (--data-parallel-size N --enable-expert-parallel), "
        raise ValueError(
            f"{model.name} weights need {weights / gb:.1f} GB in {dtype} but one {hardware.name} "
            f"offers {budget / gb:.1f} GB ({hardware.memory_bytes / gb:.1f} GB x "
            f"gpu_memory_utilization {gpu_memory_utilization}): the model does not fit on one "
            f"{hardware.name}{held if expert_parallel_size > 1 else ''}. Use "
            f"{shard if model.n_routed_experts else ''}a GPU with more memory or a smaller "
            "model (tensor parallelism is not modelled)."
        )
    block_bytes = block_size * kv_bytes_per_token(model, speculative)
    free = budget - weights - activation_reserve_bytes
    if free < block_bytes:
        raise ValueError(
            f"{model.name} on {hardware.name}: {budget / gb:.1f} GB usable minus weights "
            f"{weights / gb:.1f} GB ({dtype}) and activation reserve "
            f"{activation_reserve_bytes / gb:.1f} GB leaves {max(free, 0) / gb:.2f} GB, less "
            f"than one KV block ({block_bytes / 1e6:.1f} MB); raise gpu_memory_utilization or "
            f"pass --num-gpu-blocks."
        )
    return free // block_bytes


def check_blocks_fit(
    model: ModelConfig,
    hardware: HardwareSpec,
    num_blocks: int,
    block_size: int,
    gpu_memory_utilization: float,
    speculative: bool = False,
    expert_parallel_size: int = 1,
) -> None:
    """An explicit KV cache size must fit beside the weights: ValueError naming both."""
    budget = int(hardware.memory_bytes * gpu_memory_utilization)
    kv = num_blocks * block_size * kv_bytes_per_token(model, speculative)
    weights = rank_weight_bytes(model, expert_parallel_size)
    weights += mtp_own_weight_bytes(model, expert_parallel_size) if speculative else 0
    if weights + kv > budget:
        gb = 1e9
        raise ValueError(
            f"{model.name} on one {hardware.name}: weights {weights / gb:.1f} GB plus "
            f"num_gpu_blocks={num_blocks} x {block_size} tokens of KV cache "
            f"({kv / gb:.1f} GB) exceed the {budget / gb:.1f} GB usable "
            f"({hardware.memory_bytes / gb:.1f} GB x gpu_memory_utilization "
            f"{gpu_memory_utilization})"
        )


def kv_bytes_per_token(model: ModelConfig, speculative: bool = False) -> int:
    """Latent KV of one token: the decoder layers, plus the MTP layer when speculating."""
    extra = min(1, model.num_nextn_predict_layers) if speculative else 0
    return model.kv_bytes_per_token * (model.num_hidden_layers + extra) // model.num_hidden_layers


def rank_weight_bytes(model: ModelConfig, expert_parallel_size: int = 1) -> int:
    """Weights on one GPU when the routed experts are sharded over `expert_parallel_size`."""
    routed = model.num_moe_layers * model.n_routed_experts * model.expert_params
    sharded = routed - routed // expert_parallel_size
    return model.weight_bytes - sharded * model.dtype_bytes


def mtp_own_weight_bytes(model: ModelConfig, expert_parallel_size: int = 1) -> int:
    """The MTP layers' own weights (they share the embedding and the head); with expert
    parallelism the GPU holds 1/N of their routed experts, as of the model's layers."""
    n = model.num_nextn_predict_layers
    routed = n * model.n_routed_experts * model.expert_params
    sharded = routed - routed // expert_parallel_size
    return max(0, model.mtp_params - 2 * model.embed_params * n - sharded) * model.dtype_bytes
