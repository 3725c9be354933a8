"""SamplingParams: how to pick each output token and when to stop.

The names and meanings follow vLLM's `SamplingParams` wherever vLLM has the same
feature (`seed` and its alias `seq_seed`, `n`, `logprobs`, the stop and detokenization
options). Validated at construction: a bad value raises ValueError naming the field,
and an option this engine does not implement is refused, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.structured_outputs import check_so_args

MAX_LOGPROBS = 20  # vLLM's default max_logprobs: top tokens returned per position


@dataclass
class SamplingParams:
    n: int = 1  # completions per prompt
    best_of: int | None = None  # refused unless equal to n (vLLM V1 dropped it too)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top tokens per output position (0: the chosen one's only)
    prompt_logprobs: int | None = None
    seed: int | None = None  # deterministic sampling for this request (vLLM's name)
    seq_seed: int | None = None  # the reference engine's name for `seed`
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured outputs: {"schema_type": json|regex|ebnf|choice, "schema": ...}
    # (deepinfer/structured_outputs.py says what each means).
    so_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.seed is not None and self.seq_seed is not None and self.seed != self.seq_seed:
            raise ValueError(
                f"SamplingParams.seed={self.seed} and seq_seed={self.seq_seed}: one setting "
                "under two names; give one"
            )
        if self.seed is None:
            self.seed = self.seq_seed
        self.seq_seed = self.seed
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "must be a positive integer")
        _check(
            self.best_of in (None, self.n),
            "best_of",
            self.best_of,
            "is not supported (vLLM V1 dropped it as well): sample n completions instead",
        )
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "must be an integer")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(
            _is_int(self.top_k) and self.top_k >= 0,
            "top_k",
            self.top_k,
            "must be a non-negative integer (0 or -1 disables it)",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None:
            _check(
                _is_int(self.max_tokens) and self.max_tokens >= 1,
                "max_tokens",
                self.max_tokens,
                "must be a positive integer",
            )
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"must not exceed max_tokens={self.max_tokens}",
            )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            self.min_tokens,
            "must be a non-negative integer",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, value, "must be in [-2, 2]")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            self.repetition_penalty,
            "must be > 0",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                name,
                value,
                f"must be an integer in [0, {MAX_LOGPROBS}]",
            )
        for s in self.stop:
            _check(isinstance(s, str) and s != "", "stop", s, "entries must be non-empty strings")
        for t in self.stop_token_ids:
            _check(
                _is_int(t) and t >= 0, "stop_token_ids", t, "entries must be non-negative integers"
            )
        if self.so_args is not None:
            check_so_args(self.so_args)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r}: {why}")
