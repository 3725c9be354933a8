"""One `--kebab-case` option per SamplingParams field: the CLI's defaults are the API's."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from deepinfer.entrypoints.cli.engine_options import parse_bool
from deepinfer.sampling_params import SamplingParams

# Fields the command line leaves out: `best_of` (refused unless it equals n), the
# alias of `seed`, and `prompt_logprobs` (the offline API returns them with the prompt;
# `generate` prints completions and, with --logprobs, their tokens' logprobs).
_SKIPPED = ("best_of", "prompt_logprobs", "seq_seed")
_LISTS = {"stop": str, "stop_token_ids": int}
_OPTIONAL_INTS = ("max_tokens", "logprobs", "seed")


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling options (SamplingParams)")
    defaults = SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        if f.name in _SKIPPED:
            continue
        default = getattr(defaults, f.name)
        # --seed is the engine's: a request's sampling seed is --seq-seed (its other name)
        flag = "--seq-seed" if f.name == "seed" else "--" + f.name.replace("_", "-")
        kind: Any = {bool: parse_bool, int: int, float: float}.get(type(default), str)
        extra: dict[str, Any] = {}
        if f.name in _LISTS:
            kind, extra = _LISTS[f.name], {"nargs": "+"}
        elif f.name in _OPTIONAL_INTS:
            kind = int
        elif f.name == "so_args":  # '{"schema_type": "regex", "schema": "[0-9]+"}'
            kind = _json_object
        group.add_argument(
            flag,
            dest=f"sampling_{f.name}",
            metavar=f.name.split("_")[-1].upper(),
            type=kind,
            default=None,
            help=f"(default: {default})",
            **extra,
        )


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    values = {
        k[len("sampling_") :]: v
        for k, v in vars(args).items()
        if k.startswith("sampling_") and v is not None
    }
    return SamplingParams(**values)
