"""From a user's prompt and SamplingParams to engine requests: shared by `LLM` and the
OpenAI server.

One `InputProcessor` per model. It tokenizes text prompts (the checkpoint's tokenizer,
when it has one), checks token ids against the vocabulary, and builds a prompt's `n`
engine requests (`TrackedPrompt`), each with its incremental detokenizer, ready to be
queued. The model's other end tokens (generation_config's `eos_token_id` list) stop a
request as its EOS does, as in vLLM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepinfer.output_processor import TrackedCompletion, TrackedPrompt
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams

PromptInput = str | Sequence[int] | dict[str, Any]


class InputProcessor:
    """Tokenizes, checks and builds requests for one model.

    tokenizer: a `deepinfer.tokenizer.Tokenizer`, or None (token-id prompts only, no
    text out); eos_token_id: the executor's (one id, a list, or None); vocab_size: the
    executor's (None: prompts unchecked); model_dir: named in errors.
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_token_id: int | list[int] | None,
        vocab_size: int | None,
        model_dir: str | Path,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_ids: list[int] = (
            list(eos_token_id)
            if isinstance(eos_token_id, list)
            else ([eos_token_id] if eos_token_id is not None else [])
        )
        self.vocab_size = vocab_size
        self.model_dir = model_dir

    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{self.model_dir} has no tokenizer; pass prompts as "
                    "token ids ({'prompt_token_ids': [...]} or a list of ints)"
                )
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def check_prompt(self, index: int, token_ids: list[int]) -> None:
        """ValueError naming prompt `index` when a token id is outside the vocabulary."""
        vocab = self.vocab_size
        if vocab is None:
            return
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"prompt {index}: token id {bad} is outside the model's vocabulary [0, {vocab})"
            )

    def check_params(self, sp: SamplingParams) -> None:
        """ValueError for what this model cannot do: stop strings need a tokenizer."""
        if sp.stop and self.tokenizer is None:
            raise ValueError(
                f"SamplingParams.stop={list(sp.stop)!r}: stop strings are matched in the "
                f"text, and {self.model_dir} has no tokenizer (use stop_token_ids)"
            )

    def track(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        sp: SamplingParams,
        arrival: float,
        priority: int = 0,
    ) -> TrackedPrompt:
        """The prompt's n completions, one engine request each (not queued yet): with
        n > 1 each samples on its own (seed + k when seeded), ids `{request_id}#{k}`."""
        tracked = TrackedPrompt(request_id, text, token_ids)
        for k in range(sp.n):
            sub = sp
            if sp.n > 1:
                seed = None if sp.seed is None else sp.seed + k
                sub = dataclasses.replace(sp, n=1, best_of=None, seed=seed, seq_seed=seed)
            rid = request_id if sp.n == 1 else f"{request_id}#{k}"
            req = self._request(rid, token_ids, sub, arrival, priority)
            tracked.completions.append(TrackedCompletion(req, k, self._detokenizer(token_ids, sub)))
        return tracked

    def _request(
        self, req_id: str, token_ids: list[int], sp: SamplingParams, arrival: float, priority: int
    ) -> Request:
        eos = self.eos_ids[0] if self.eos_ids else None
        extra = [t for t in self.eos_ids[1:] if t not in sp.stop_token_ids]
        if extra and not sp.ignore_eos:  # generation_config's other end tokens stop too
            sp = dataclasses.replace(sp, stop_token_ids=list(sp.stop_token_ids) + extra)
        return Request(req_id, token_ids, sp, arrival, eos_token_id=eos, priority=priority)

    def _detokenizer(self, token_ids: list[int], sp: SamplingParams) -> Any:
        if self.tokenizer is None:
            return None
        from deepinfer.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(
            self.tokenizer,
            token_ids,
            stop=list(sp.stop),
            skip_special_tokens=sp.skip_special_tokens,
            include_stop_str_in_output=sp.include_stop_str_in_output,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
            min_tokens=sp.min_tokens,
        )


def maybe_tokenizer(model_dir: Any, trust_remote_code: bool = False) -> Any:
    """The checkpoint's tokenizer, or None when it has none (token-id prompts still work,
    e.g. a preset with load_format="dummy")."""
    from deepinfer.tokenizer import load_tokenizer

    try:
        return load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
    except FileNotFoundError:
        return None
