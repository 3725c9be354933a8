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
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.executor import get_executor_class
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.request import FinishReason, Request
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptInput = str | Sequence[int] | dict[str, Any]


class LLM:
    """An offline engine over one model.

    `model`: a checkpoint directory or a hub id. Engine options are the
    EngineConfig names (`block_size=64`, `max_num_seqs=8`, ...); an unknown
    name is an error naming it.
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
        **engine_args: Any,
    ) -> None:
        self.config = EngineConfig.from_dict(engine_args, source="LLM(...)")
        cls = get_executor_class(executor)
        # enforce_eager: no CUDA graphs for decode steps (vLLM's name)
        t0 = time.perf_counter()
        self.executor = cls(
            self.config,
            model,
            dtype=dtype,
            device=device,
            load_format=load_format,
            revision=revision,
            enforce_eager=enforce_eager,
        )
        self.tokenizer = _maybe_tokenizer(self.executor.model_dir, trust_remote_code)
        self.engine = EngineCore(
            self.config, self.executor, model_max_len=self.executor.max_model_len
        )
        eos = self.executor.eos_token_id
        self._eos_ids: list[int] = (
            list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
        )
        self._ids = itertools.count()
        # Model load, KV sizing, kernel warm-up and graph capture: paid here, not by requests.
        self.startup_seconds = time.perf_counter() - t0
        logger.info("LLM(%s) started in %.1f s", model, self.startup_seconds)

    @property
    def max_model_len(self) -> int:
        return self.engine.scheduler.max_model_len

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order."""
        batch = _as_list(prompts)
        params = _params_for(batch, sampling_params)
        tracked: dict[str, _Tracked] = {}
        order: list[str] = []
        for prompt, sp in zip(batch, params):
            text, token_ids = self._tokenize(prompt)
            req = self._make_request(token_ids, sp)
            order.append(req.request_id)
            tracked[req.request_id] = _Tracked(req, text, self._detokenizer(token_ids, sp))
            self.engine.add_request(req)
        self._run(tracked, use_tqdm)
        return [tracked[rid].output() for rid in order]

    # ---- internals -------------------------------------------------------------------

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{self.executor.model_dir} has no tokenizer; pass prompts as "
                    "token ids ({'prompt_token_ids': [...]} or a list of ints)"
                )
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def _make_request(self, token_ids: list[int], sp: SamplingParams) -> Request:
        eos = self._eos_ids[0] if self._eos_ids else None
        extra = [t for t in self._eos_ids[1:] if t not in sp.stop_token_ids]
        if extra and not sp.ignore_eos:  # generation_config's other end tokens stop too
            sp = dataclasses.replace(sp, stop_token_ids=list(sp.stop_token_ids) + extra)
        return Request(str(next(self._ids)), token_ids, sp, self.engine.clock(), eos_token_id=eos)

    def _detokenizer(self, token_ids: list[int], sp: SamplingParams) -> Any:
        if self.tokenizer is None:
            return None
        from deepinfer.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, token_ids, stop=list(sp.stop))

    def _run(self, tracked: dict[str, _Tracked], use_tqdm: bool) -> None:
        from tqdm import tqdm

        live = {rid for rid, t in tracked.items() if not t.req.is_finished}
        with tqdm(
            total=len(tracked),
            desc="generating",
            unit="req",
            disable=not use_tqdm,
            initial=len(tracked) - len(live),
            leave=False,
        ) as bar:
            while live:
                for req in self.engine.step():
                    t = tracked.get(req.request_id)
                    if t is None:
                        continue
                    if t.feed() and not req.is_finished:
                        self.engine.finish(req.request_id, FinishReason.STOP)
                    if req.is_finished and req.request_id in live:
                        live.discard(req.request_id)
                        bar.update(1)
                if not self.engine.has_unfinished():
                    break


@dataclasses.dataclass
class _Tracked:
    req: Request
    prompt: str | None
    detok: Any  # IncrementalDetokenizer or None
    num_fed: int = 0

    def feed(self) -> bool:
        """Detokenize new tokens; True once a stop string appeared."""
        new = self.req.output_token_ids[self.num_fed :]
        self.num_fed += len(new)
        if self.detok is None or not new:
            return False
        self.detok.append(new)
        return self.detok.stop_hit is not None

    def output(self) -> RequestOutput:
        req = self.req
        if self.detok is not None:
            self.detok.flush()
        text = self.detok.text if self.detok is not None else ""
        reason = req.finish_reason.value if req.finish_reason is not None else None
        stop_reason = self.detok.stop_hit if self.detok is not None else None
        if stop_reason is None and reason == "stop" and req.output_token_ids:
            stop_reason = req.output_token_ids[-1]
        completion = CompletionOutput(
            0,
            text,
            list(req.output_token_ids),
            reason,
            logprobs=req.logprobs or None,
            stop_reason=stop_reason,
        )
        return RequestOutput(
            req.request_id,
            self.prompt,
            req.token_ids(0, req.num_prompt_tokens),
            [completion],
            req.is_finished,
            max(req.num_cached_tokens, 0),
            error=req.reject_reason,
        )


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


def _maybe_tokenizer(model_dir: Any, trust_remote_code: bool) -> Any:
    from deepinfer.tokenizer import load_tokenizer

    try:
        return load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    except FileNotFoundError:
        return None  # token-id prompts still work (e.g. load_format="dummy")
