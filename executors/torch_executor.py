"""TorchExecutor: the real executor (registered as "torch"): loads the checkpoint,
sizes the paged KV cache and runs each scheduled step through the ModelRunner.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from deepinfer import envs
from deepinfer.config import EngineConfig
from deepinfer.executor import Executor
from deepinfer.kv_cache.handover import KVHandover
from deepinfer.kv_cache.hashing import update_block_hashes
from deepinfer.kv_cache.tiers import HOST, KVTiers, TierLRU
from deepinfer.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from executors.batch_invariant import check_supported
from executors.distributed.expert_parallel import ExpertParallel
from executors.host_kv_tier import HostKVTier, check_host_tier
from executors.kv_cache import (
    PagedKVCache,
    bytes_per_block,
    cpu_num_blocks,
    cuda_num_blocks,
    num_kv_layers,
    num_mtp_kv_layers,
)
from executors.loader import load_model, read_model_config, resolve_dtype, resolve_model_dir
from executors.model_runner import ModelRunner
from executors.sampler import SamplingState, sample_on_device
from executors.step_handle import PendingStep
from executors.structured_outputs import GrammarCompiler
from executors.warmup import WarmupReport, freeze_heap, release_dropped_engines, warm_up

logger = logging.getLogger(__name__)


class TorchExecutor(Executor):
    needs_token_ids = True

    def __init__(
        self,
        engine_config: EngineConfig,
        model: str,
        *,
        dtype: str | None = None,
        device: str | None = None,
        load_format: str = "auto",
        revision: str | None = None,
        enforce_eager: bool = False,
        cuda_graph_sizes: list[int] | None = None,
        trust_remote_code: bool = False,
        dp_rank: int | None = None,
    ) -> None:
        """enforce_eager: no CUDA graphs (they capture decode steps on CUDA by default);
        cuda_graph_sizes: the batch sizes captured (default: default_capture_sizes);
        trust_remote_code: the tokenizer's own class may load (structured outputs);
        dp_rank: this executor is that data-parallel rank (executors/distributed launches
        them; with expert parallelism the torch.distributed group must exist already)."""
        t0 = time.perf_counter()
        if engine_config.data_parallel_size > 1 and dp_rank is None:
            raise ValueError(
                f"data_parallel_size={engine_config.data_parallel_size}: a TorchExecutor is one "
                "rank; LLM(...) and `deepinfer generate` launch the ranks"
            )
        check_host_tier(engine_config)
        self.engine_config = engine_config
        self.model_dir: Path = resolve_model_dir(
            model, revision=revision, weights=load_format != "dummy"
        )
        self.config = read_model_config(self.model_dir).with_quantization(
            engine_config.quantization
        )
        self.vocab_size = self.config.vocab_size  # the engine checks prompts against it
        self.device = _device(device) if device else _default_device()
        if self.device.type == "cpu":  # process-wide: see envs.cpu_threads
            torch.set_num_threads(envs.cpu_threads())
        if engine_config.batch_invariant:
            check_supported(self.config, self.device, engine_config.block_size)
            if self.config.quant_method is not None:
                raise ValueError(
                    f"batch_invariant=True with {self.config.quant_method} weights: the "
                    "batch-invariant GEMMs are bf16 kernels (no FP8 path yet); use one of "
                    "the two"
                )
        self.dtype = resolve_dtype(self.config, dtype, self.device)
        self.config.check_max_model_len(engine_config.max_model_len)
        k = engine_config.num_speculative_tokens
        if k and not self.config.num_nextn_predict_layers:
            raise ValueError(
                f"num_speculative_tokens={k}: drafts come from the model's MTP layers and "
                f"{self.config.name} has none (num_nextn_predict_layers=0)"
            )
        self.max_model_len = engine_config.max_model_len or self.config.max_position_embeddings
        self.expert_parallel = self._expert_parallel(dp_rank)
        if self.device.type == "cuda":
            release_dropped_engines()
            _check_fits(self.config, self.dtype, self.device, engine_config)
        self.eos_token_id = self._eos_token_id()
        self.model = load_model(
            self.model_dir,
            self.config,
            dtype=self.dtype,
            device=self.device,
            load_format=load_format,
            seed=engine_config.seed,
            ep=self.expert_parallel,
        )
        if k and self.model.mtp is None:
            raise ValueError(
                f"num_speculative_tokens={k}: the checkpoint in {self.model_dir} has no MTP "
                f"weights (layer {self.config.num_hidden_layers}); drafts need them"
            )
        num_blocks = self._num_blocks()
        if self.expert_parallel is not None:
            # Equal caches on every rank: free memory differs a little between GPUs, and the
            # warm-up's steps (one MoE exchange each) follow the cache size.
            num_blocks = self.expert_parallel.agree_min(num_blocks, self.device)
        # Expert-parallel steps exchange host-sized splits: they run eagerly.
        use_graphs = self.device.type == "cuda" and not enforce_eager and not self.expert_parallel
        self.kv_cache = PagedKVCache(
            self.config.num_hidden_layers,
            num_blocks,
            engine_config.block_size,
            self.config.kv_entry_dim,
            self.dtype,
            self.device,
            scratch_block=use_graphs,
            num_mtp_layers=num_mtp_kv_layers(self.config, engine_config),
        )
        first_eos = (
            self.eos_token_id[0] if isinstance(self.eos_token_id, list) else self.eos_token_id
        )
        self.runner = ModelRunner(
            self.model, self.kv_cache, engine_config, first_eos, max_model_len=self.max_model_len
        )
        if engine_config.kv_host_cache_gib > 0:
            self.runner.host_tier = HostKVTier(self.kv_cache, self._host_kv_slots())
        # Everything a served step can need is compiled (and captured) now, not on first use.
        self.warmup: WarmupReport | None = None
        if self.device.type == "cuda":
            self.warmup = warm_up(
                self.runner, engine_config.max_num_batched_tokens, engine_config.max_num_seqs
            )
        if use_graphs:
            self.runner.enable_cuda_graphs(cuda_graph_sizes)
        eos = self.eos_token_id
        self.runner.requests.grammars = GrammarCompiler(  # loads xgrammar at the first so_args
            self.model_dir,
            self.vocab_size,
            list(eos) if isinstance(eos, list) else ([eos] if eos is not None else []),
            trust_remote_code=trust_remote_code,
        )
        # Start-up's objects live as long as the engine: a full collection would scan them
        # all, in a served step (on the device, the pause idles it).
        self._froze_heap = self.device.type == "cuda"
        if self._froze_heap:
            freeze_heap()
        self.startup_seconds = time.perf_counter() - t0
        logger.info(
            "TorchExecutor: %s on %s in %s, %d KV blocks of %d tokens; started in %.1f s",
            self.model_dir,
            self.device,
            self.dtype,
            num_blocks,
            engine_config.block_size,
            self.startup_seconds,
        )

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(out)

    def _expert_parallel(self, dp_rank: int | None) -> ExpertParallel | None:
        cfg = self.engine_config
        if not cfg.enable_expert_parallel:
            return None
        if not self.config.n_routed_experts:
            raise ValueError(
                f"enable_expert_parallel: {self.config.name} has no routed experts to shard"
            )
        assert dp_rank is not None  # (data_parallel_size > 1, checked above)
        return ExpertParallel(
            dp_rank, cfg.data_parallel_size, self.config.n_routed_experts, device=self.device,
            speculative=cfg.num_speculative_tokens > 0,
        )  # fmt: skip

    def prepare_grammar(self, so_args: dict[str, Any]) -> Future[Any]:
        """Start compiling `so_args`'s grammar in a worker (cached by schema); ValueError
        when structured outputs cannot work here (no xgrammar, no tokenizer)."""
        assert self.runner.requests.grammars is not None
        return self.runner.requests.grammars.submit(so_args)

    def execute_async(self, out: SchedulerOutput) -> PendingStep:
        """Queues the step on the device; the handle's `result()` waits for it
        (executors/step_handle.py: async scheduling launches the next step first). On
        CUDA two timing events on the compute stream bracket the launch's device work,
        the step log's device time (`PendingStep.device_seconds`); recording them does
        not synchronise. On the CPU the launch runs the step: its duration is its time."""
        if self.device.type != "cuda" or out.is_empty:
            handle = self.runner.launch(out)
            handle.ran_in_launch = self.device.type == "cpu"  # torch ran it as it was called
            return handle
        stream = torch.cuda.current_stream(self.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        handle = self.runner.launch(out)
        end.record(stream)
        handle.events = (start, end)
        return handle

    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def kv_tiers(self, given: KVTiers | None) -> KVTiers | None:
        """The host tier of kv_host_cache_gib (its slots: `HostKVTier`), or None. Tiers
        built elsewhere are refused: this executor copies blocks to its own host memory
        only, never to a shared store (a simulator plan)."""
        if given is not None:
            store = given.store is not None
            raise ValueError(
                f"kv_tiers with {'a shared KV store' if store else 'a host KV tier'}: the "
                "torch executor copies prefix blocks to its own host memory only, sized by "
                "kv_host_cache_gib" + ("; the store is a simulator plan" if store else "")
            )
        tier = self.runner.host_tier
        return None if tier is None else KVTiers(TierLRU(HOST, tier.num_slots))

    def export_kv(self, request: Request, num_tokens: int) -> KVHandover:
        """`request`'s positions [0, num_tokens) from every layer, one device tensor
        [num_tokens, layers, entry_dim] (executors/kv_transfer.py), with the chain hashes
        of its full blocks. The runner must still hold the request: call it after the
        step that ended it, before the engine's next step."""
        state = self.runner.requests.get(request.request_id)
        if state is None:
            raise ValueError(
                f"export_kv({request.request_id!r}): this executor holds no such request "
                "(it must be exported before the engine's next step forgets it)"
            )
        if num_tokens > state.num_computed:
            raise ValueError(
                f"export_kv({request.request_id!r}, {num_tokens}): only {state.num_computed} "
                "of its tokens are in the cache"
            )
        kv = self.runner.kv_transfer.export(state.block_table, num_tokens)
        bs = self.engine_config.block_size
        hashes = tuple(update_block_hashes(request, bs)[: num_tokens // bs])
        return KVHandover(request.request_id, num_tokens, bs, hashes, kv, kv.nbytes)

    def import_kv(self, handover: KVHandover) -> None:
        """Held until the request's first schedule, written before that step's forward."""
        self.runner.kv_transfer.add(handover)

    def can_overlap(self, out: SchedulerOutput) -> bool:
        """Whether `out`, launched now, runs beside the step in flight (ModelRunner)."""
        return self.runner.can_overlap(out)

    def settle_kv_saves(self, out: SchedulerOutput) -> None:
        if self.runner.host_tier is not None:
            self.runner.host_tier.settle(out)

    def discard_pending(self) -> None:
        """The engine dropped its step in flight (EngineCore._fail, discard_in_flight)."""
        self.runner.discard_pending()

    def shutdown(self) -> None:
        if self._froze_heap:  # (the graphs' and modules' cycles must be collectable again)
            gc.unfreeze()
            self._froze_heap = False
        if self.runner.requests.grammars is not None:
            self.runner.requests.grammars.shutdown()
        self.runner.requests.clear()
        self.runner.discard_pending()
        self.runner.host_tier = None  # (its pinned host memory)
        # What holds device memory goes, even while the caller still holds this executor:
        # the caches, the graphs (their private pools), the drafter and the weights.
        self.kv_cache.layers.clear()
        self.kv_cache.mtp_layers.clear()
        self.runner.graphs = self.runner.piecewise = None
        self.runner.verify_graphs_by_len = {}
        self.runner.speculator = None
        if self.device.type == "cuda":
            self.model.to("meta")
            gc.collect()  # graphs and modules hold reference cycles
            torch.cuda.empty_cache()

    def _eos_token_id(self) -> int | list[int] | None:
        """generation_config.json's eos_token_id when present, else config.json's."""
        gen = self.model_dir / "generation_config.json"
        if gen.is_file():
            with open(gen) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return eos
        return self.config.eos_token_id

    def _host_kv_slots(self) -> int:
        """Blocks of kv_host_cache_gib (at least one, as the simulator sizes a tier): a
        block is block_size x layers (the MTP layer's too when speculating) x
        (kv_lora_rank + qk_rope_head_dim) values in the cache's dtype."""
        cfg = self.engine_config
        per_block = bytes_per_block(
            self.config, cfg.block_size, self.dtype, num_kv_layers(self.config, cfg)
        )
        return max(1, int(cfg.kv_host_cache_gib * (1 << 30)) // per_block)

    def _num_blocks(self) -> int:
        if self.device.type != "cuda":
            return cpu_num_blocks(self.engine_config, self.config, self.dtype, self.max_model_len)
        return cuda_num_blocks(
            self.engine_config, self.config, self.dtype, self.device, self._profile_run
        )

    def _profile_run(self) -> None:
        """One prefill of a full token budget into a throwaway cache, then the sampler
        (`_profile_sampler`), to measure the peak."""
        n = min(self.engine_config.max_num_batched_tokens, self.max_model_len)
        bs = self.engine_config.block_size
        blocks = -(-n // bs)
        cache = PagedKVCache(
            self.config.num_hidden_layers,
            blocks,
            bs,
            self.config.kv_entry_dim,
            self.dtype,
            self.device,
            num_mtp_layers=num_mtp_kv_layers(self.config, self.engine_config),
        )
        runner = ModelRunner(self.model, cache, self.engine_config)
        req = ScheduledRequest(
            req_id="profile",
            num_tokens=n,
            num_computed_tokens=0,
            is_prompt=True,
            will_sample=True,
            new_block_ids=[],
            block_table=list(range(blocks)),
            token_ids=[0] * n,
            num_prompt_tokens=n,
        )
        runner.execute(SchedulerOutput(step_id=-1, scheduled=[req]))
        del runner, cache
        self._profile_sampler()

    def _profile_sampler(self) -> None:
        """The sampler's peak: logits of max_num_seqs requests x (1 + drafts) rows (at most
        the token budget), sampled with every filter and logprobs on; under async
        scheduling beside the logits of the step before, which its pending result holds
        until the step after it is launched. The prefill above samples one row, and at
        batch 256 x 3 drafts of a 163,840-token vocabulary one float32 copy of the logits
        is 0.7 GB (the sampler makes several: temperature, sort, probabilities)."""
        cfg = self.engine_config
        rows = min(cfg.max_num_seqs * (1 + cfg.num_speculative_tokens), cfg.max_num_batched_tokens)
        hidden = torch.zeros(rows, self.config.hidden_size, dtype=self.dtype, device=self.device)
        held = self.model.compute_logits(hidden) if cfg.async_scheduling else None
        logits = self.model.compute_logits(hidden)  # [rows, vocab]
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, logprobs=1)
        sample_on_device(logits, [SamplingState(params, [])] * rows)
        del held


def _device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device={name!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device={name!r}: this torch ({torch.__version__}) sees no CUDA device; install a "
            "CUDA build of torch on a machine with a GPU, or use device='cpu'"
        )
    return dev


def _check_fits(cfg: Any, dtype: torch.dtype, device: torch.device, engine: EngineConfig) -> None:
    """Weights (and an explicit KV cache) must fit the device: ValueError naming both."""
    total = torch.cuda.get_device_properties(device).total_memory
    budget = total * engine.gpu_memory_utilization
    params = cfg.total_params + cfg.mtp_params
    if engine.enable_expert_parallel:  # 1/N of the routed experts, the MTP layers' too
        layers = cfg.num_moe_layers + cfg.num_nextn_predict_layers
        routed = layers * cfg.n_routed_experts * cfg.expert_params
        params -= routed - routed // engine.data_parallel_size
    weights = params * dtype.itemsize
    kv = 0
    if engine.num_gpu_blocks is not None:
        kv = (
            engine.num_gpu_blocks
            * engine.block_size
            * cfg.kv_entry_dim
            * (num_kv_layers(cfg, engine) * dtype.itemsize)
        )
    if weights + kv > budget:
        gb = 1e9
        raise ValueError(
            f"{cfg.name} needs {weights / gb:.1f} GB of weights in {dtype}"
            + (
                f" plus {kv / gb:.1f} GB of KV cache (num_gpu_blocks={engine.num_gpu_blocks})"
                if kv
                else ""
            )
            + f", more than the {budget / gb:.1f} GB usable on {torch.cuda.get_device_name(device)}"
            f" ({total / gb:.1f} GB x gpu_memory_utilization {engine.gpu_memory_utilization})"
        )


def _default_device() -> torch.device:
    accel = envs.accelerator()
    if accel == "cpu" or (accel is None and not torch.cuda.is_available()):
        return torch.device("cpu")
    if accel == "ascend":
        raise RuntimeError(
            "DEEPINFER_ACCELERATOR=ascend: the torch executor supports only nvidia (CUDA) and cpu"
        )
    return torch.device("cuda", torch.cuda.current_device())
