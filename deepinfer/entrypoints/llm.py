"""LLM: the offline API, `LLM(model=...).generate(prompts, SamplingParams(...))`.

The engine is the same EngineCore the simulator drives; this layer adds
tokenization, incremental detokenization with stop strings, and vLLM-style
RequestOutputs. The executor (torch by default) is imported on construction.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepinfer.config import EngineConfig, EngineRole
from deepinfer.data_parallel.front_end import DataParallelEngine
from deepinfer.disaggregated_engine import DisaggregatedEngine, parse_disaggregation
from deepinfer.engine import EngineCore
from deepinfer.entrypoints.executor_registry import get_executor_class
from deepinfer.entrypoints.input_processor import InputProcessor, PromptInput, maybe_tokenizer
from deepinfer.output_processor import TrackedCompletion, TrackedPrompt
from deepinfer.outputs import RequestOutput
from deepinfer.request import FinishReason
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """An offline engine over one model.

    `model`: a checkpoint directory or a hub id. Engine options are the
    EngineConfig names (`block_size=64`, `max_num_seqs=8`, ...); an unknown
    name is an error naming it. `data_parallel_size=N` serves from N ranks, one process
    each (with `enable_expert_parallel=True` their MoE experts are sharded over them).
    `disaggregate="1P1D"` serves from prefill engines and decode engines in this process
    (their counts, 'xPyD'), each request's prompt KV handed from one to the other
    (deepinfer/disaggregated_engine.py).
    check_invariants: every scheduler (every rank's) checks its invariants each step.
    step_log: write every step of the engine (its shape, host and device seconds) to this
    file, the step log `deepinfer profile --from-log` fits a profile from
    (deepinfer/step_log_file.py); one engine only.
    """

    def __init__(
        self,
        model: str,
        *,
        executor: str = "torch",
        dtype: str | None = None,
        device: str | None = None,
        load_format: str = "auto",
        revision: str | None = None,
        trust_remote_code: bool = False,
        enforce_eager: bool = False,
        check_invariants: bool = False,
        disaggregate: str | None = None,
        step_log: str | Path | None = None,
        **engine_args: Any,
    ) -> None:
        self.config = EngineConfig.from_dict(engine_args, source="LLM(...)")
        # enforce_eager: no CUDA graphs for decode steps (vLLM's name)
        kwargs: dict[str, Any] = dict(
            dtype=dtype,
            device=device,
            load_format=load_format,
            revision=revision,
            enforce_eager=enforce_eager,
            trust_remote_code=trust_remote_code,
        )
        if step_log is not None and (disaggregate or self.config.data_parallel_size > 1):
            raise ValueError(
                "step_log: a step log holds one engine's steps; this LLM serves from several "
                f"(disaggregate={disaggregate!r}, data_parallel_size="
                f"{self.config.data_parallel_size})"
            )
        if step_log is not None and executor != "torch":
            raise ValueError(f"step_log: the {executor!r} executor writes none")
        t0 = time.perf_counter()
        self.engine: EngineCore | DataParallelEngine | DisaggregatedEngine
        # What LLM needs of the model (model_dir, vocab_size, eos_token_id): an executor,
        # or a data-parallel rank's RankInfo.
        self.executor: Any
        if disaggregate is not None:
            self.engine = _disaggregated(
                self.config, disaggregate, model, executor, kwargs, check_invariants
            )
            self.executor = self.engine.decode.engines[0].executor
        elif self.config.data_parallel_size > 1:
            self.engine = _launch_ranks(self.config, model, executor, kwargs, check_invariants)
            # What the front-end needs of the model (model_dir, vocab_size, eos_token_id).
            self.executor = self.engine.infos[0]
        else:
            if executor == "sim":
                raise ValueError(
                    "LLM(executor='sim'): the offline API generates text with a model; the "
                    "simulator replays request traces (`deepinfer simulate`, sim.simulate)"
                )
            self.executor = get_executor_class(executor)(self.config, model, **kwargs)
            writer = None
            if step_log is not None:
                from executors.profile_env import step_log_writer

                writer = step_log_writer(step_log, self.executor, self.config, model)
            try:
                self.engine = EngineCore(
                    self.config, self.executor, model_max_len=self.executor.max_model_len,
                    check_invariants=check_invariants, step_writer=writer,
                )  # fmt: skip
            except BaseException:  # (a refused option: the log holds its header only)
                if writer is not None:
                    writer.close()
                raise
        self.tokenizer = maybe_tokenizer(self.executor.model_dir, trust_remote_code)
        self.processor = InputProcessor(
            self.tokenizer,
            self.executor.eos_token_id,
            self.executor.vocab_size,  # (the executor's, or rank 0's RankInfo)
            self.executor.model_dir,
        )
        self._ids = itertools.count()
        # Model load, KV sizing, kernel warm-up and graph capture: paid here, not by requests.
        self.startup_seconds = time.perf_counter() - t0
        logger.info("LLM(%s) started in %.1f s", model, self.startup_seconds)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def shutdown(self) -> None:
        """Release the executor (and stop the data-parallel ranks' processes)."""
        if isinstance(self.engine, (DataParallelEngine, DisaggregatedEngine)):
            self.engine.shutdown()
        else:
            if self.engine.step_writer is not None:  # (its last span is read off the device)
                self.engine.step_writer.close()
            self.executor.shutdown()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.

        Every prompt is checked before any is queued (a bad one is a ValueError naming
        it), and so is every `so_args` this executor cannot serve; their grammars start
        compiling here. An interrupted call (Ctrl-C) aborts its requests, so the LLM stays
        usable. `priority`: one int a prompt, lower starts first (vLLM's meaning); only
        with `policy="priority"`.
        """
        batch = _as_list(prompts)
        params = _params_for(batch, sampling_params)
        priorities = self._priorities(priority, len(batch))
        encoded = [self.processor.tokenize(p) for p in batch]
        for i, (_, ids) in enumerate(encoded):
            self.processor.check_prompt(i, ids)
        for sp in params:
            self.processor.check_params(sp)
            if isinstance(self.engine, DisaggregatedEngine):
                self.engine.check_params(sp)
            if sp.so_args is not None:
                self._prepare_grammar(sp.so_args)
        tracked = [
            self._track(text, ids, sp, prio)
            for (text, ids), sp, prio in zip(encoded, params, priorities)
        ]
        completions = {c.req.request_id: c for t in tracked for c in t.completions}
        try:
            self._run(completions, use_tqdm)
        except BaseException:
            for c in completions.values():
                if not c.req.is_finished:
                    self.engine.abort(c.req.request_id)
            self.engine.discard_in_flight()
            raise
        return [t.output(self.tokenizer) for t in tracked]

    # ---- internals -------------------------------------------------------------------

    def _prepare_grammar(self, so_args: dict[str, Any]) -> None:
        """Start compiling (cached); ValueError when the executor cannot serve it."""
        if isinstance(self.engine, DataParallelEngine):
            raise ValueError(
                "SamplingParams.so_args: structured outputs are not supported with "
                f"data_parallel_size={self.config.data_parallel_size} yet"
            )
        self.executor.prepare_grammar(so_args)

    def _priorities(self, priority: Sequence[int] | None, num_prompts: int) -> list[int]:
        if priority is None:
            return [0] * num_prompts
        if self.config.policy != "priority":
            raise ValueError(
                f"priority: the engine schedules {self.config.policy!r}; priorities need "
                "policy='priority' (LLM(..., policy='priority'))"
            )
        values = list(priority)
        if len(values) != num_prompts:
            raise ValueError(f"priority: {len(values)} values for {num_prompts} prompts")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ValueError(f"priority: expected ints, got {values!r}")
        return values

    def _track(
        self, text: str | None, token_ids: list[int], sp: SamplingParams, priority: int = 0
    ) -> TrackedPrompt:
        """Queue the prompt's n completions (one engine request each)."""
        tracked = self.processor.track(
            str(next(self._ids)), text, token_ids, sp, self.engine.clock(), priority
        )
        for c in tracked.completions:
            self.engine.add_request(c.req)
        return tracked

    def _run(self, completions: dict[str, TrackedCompletion], use_tqdm: bool) -> None:
        from tqdm import tqdm

        live = {rid for rid, c in completions.items() if not c.req.is_finished}
        with tqdm(total=len(completions), desc="generating", unit="req", disable=not use_tqdm,
                  initial=len(completions) - len(live), leave=False) as bar:  # fmt: skip
            while live:
                for req in self.engine.step():
                    c = completions.get(req.request_id)
                    if c is None:
                        continue
                    if c.feed():  # a stop string ended the text
                        if not req.is_finished:
                            self.engine.finish(req.request_id, FinishReason.STOP)
                        elif isinstance(self.engine, EngineCore):
                            self.engine.restate_record(req)  # ended on a later token
                    if req.is_finished and req.request_id in live:
                        live.discard(req.request_id)
                        bar.update(1)
                if not self.engine.has_unfinished():
                    break
            # Async scheduling launched a step for requests that then ended: read it, so
            # the engine is idle when generate returns (it did no work that counts).
            # (The data-parallel front-end steps synchronously: nothing is left in flight.)
            if isinstance(self.engine, EngineCore):
                sched = self.engine.scheduler
                while self.engine.has_unfinished() and not sched.has_unfinished():
                    self.engine.step()
            elif isinstance(self.engine, DisaggregatedEngine):
                self.engine.drain()


def _launch_ranks(
    config: EngineConfig, model: str, executor: str, kwargs: dict[str, Any], check: bool
) -> DataParallelEngine:
    if executor != "torch":
        raise ValueError(
            f"data_parallel_size={config.data_parallel_size} with executor={executor!r}: "
            "LLM launches data-parallel ranks of the torch executor only (the simulator "
            "models them: `deepinfer simulate --data-parallel-size N`)"
        )
    from executors.distributed.launch import launch_data_parallel

    return launch_data_parallel(config, model, check_invariants=check, **kwargs)


def _disaggregated(
    config: EngineConfig,
    spec: str,
    model: str,
    executor: str,
    kwargs: dict[str, Any],
    check: bool,
) -> DisaggregatedEngine:
    """The prefill and decode engines `spec` ('1P1D') names, each its own executor of
    `model` with `config` in its role, behind one router per role."""
    num_prefill, num_decode = parse_disaggregation(spec)
    if config.role is not EngineRole.NORMAL:
        raise ValueError(
            f"disaggregate={spec!r} with role={config.role.value!r}: disaggregate sets each "
            "engine's role; leave role unset"
        )
    if config.data_parallel_size > 1:
        raise ValueError(
            f"disaggregate={spec!r} with data_parallel_size={config.data_parallel_size}: "
            "the engines of a disaggregated LLM are single ranks"
        )
    if executor != "torch":
        raise ValueError(
            f"disaggregate={spec!r} with executor={executor!r}: LLM hands KV over between "
            "torch executors (the simulator models disaggregation: `deepinfer simulate "
            "--cluster`)"
        )
    cls = get_executor_class(executor)

    def engine(role: EngineRole) -> EngineCore:
        cfg = dataclasses.replace(config, role=role)
        ex = cls(cfg, model, **kwargs)
        return EngineCore(cfg, ex, model_max_len=ex.max_model_len, check_invariants=check)

    prefill = [engine(EngineRole.PREFILL) for _ in range(num_prefill)]
    decode = [engine(EngineRole.DECODE) for _ in range(num_decode)]
    return DisaggregatedEngine(prefill, decode, seed=config.seed)


def _as_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # type: ignore[arg-type]  # one prompt as token ids
    return items  # type: ignore[return-value]


def _params_for(
    batch: list[PromptInput], params: SamplingParams | Sequence[SamplingParams] | None
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in batch]
    if isinstance(params, SamplingParams):
        return [params] * len(batch)
    params = list(params)
    if len(params) != len(batch):
        raise ValueError(f"sampling_params: {len(params)} given for {len(batch)} prompts")
    return params
