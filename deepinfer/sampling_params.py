"""SamplingParams: how to pick each output token and when to stop.

Validated at construction: a bad value raises ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_SCHEMA_TYPES = ("regex", "json", "ebnf")


@dataclass
class SamplingParams:
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
    logprobs: int | None = None
    seq_seed: int | None = None
    so_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            self.top_k,
            "must be a non-negative integer (0 or -1 disables it)",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None:
            _check(
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "max_tokens",
                self.max_tokens,
                "must be a positive integer",
            )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            self.min_tokens,
            "must be a non-negative integer",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"must not exceed max_tokens={self.max_tokens}",
            )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            self.presence_penalty,
            "must be in [-2, 2]",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            self.frequency_penalty,
            "must be in [-2, 2]",
        )
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            self.repetition_penalty,
            "must be > 0",
        )
        if self.logprobs is not None:
            _check(
                isinstance(self.logprobs, int) and self.logprobs >= 0,
                "logprobs",
                self.logprobs,
                "must be a non-negative integer",
            )
        for s in self.stop:
            _check(isinstance(s, str) and s != "", "stop", s, "entries must be non-empty strings")
        for t in self.stop_token_ids:
            _check(
                isinstance(t, int) and t >= 0,
                "stop_token_ids",
                t,
                "entries must be non-negative integers",
            )
        if self.so_args is not None:
            _check_so_args(self.so_args)
            raise ValueError(
                "SamplingParams.so_args: structured outputs are not implemented "
                "yet by any executor; leave so_args unset"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r}: {why}")


def _check_so_args(so_args: dict[str, Any]) -> None:
    if not isinstance(so_args, dict):
        raise ValueError(f"SamplingParams.so_args={so_args!r}: must be a dict")
    unknown = set(so_args) - {"schema_type", "schema"}
    _check(not unknown, "so_args", sorted(unknown), "unknown keys (expected schema_type, schema)")
    kind = so_args.get("schema_type")
    _check(kind in _SCHEMA_TYPES, "so_args.schema_type", kind, f"expected one of {_SCHEMA_TYPES}")
    _check(
        "schema" in so_args and so_args["schema"] not in (None, ""),
        "so_args.schema",
        so_args.get("schema"),
        "is required",
    )
