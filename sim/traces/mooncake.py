"""Mooncake traces (FAST'25 release and the earlier arXiv trace): JSONL.

Each line: ``{"timestamp": ms since the trace start, "input_length",
"output_length", "hash_ids": [...]}``. `hash_ids` name the prompt's
512-token blocks (the release README: "The block size is 512 tokens";
len(hash_ids) == ceil(input_length / 512)); they become `prefix_blocks`.
Timestamps are kept as they are (already relative to the trace start).
"""

from __future__ import annotations

import json
from pathlib import Path

from sim.traces.fields import (
    FieldError,
    ZeroLengths,
    check_blocks_fit,
    parse_block_ids,
    parse_int,
    parse_seconds,
)
from sim.traces.model import Trace, TraceError, TraceRequest

BLOCK_SIZE = 512
KEYS = ("timestamp", "input_length", "output_length")
_COUNT = "a non-negative integer"


def load_mooncake(path: Path) -> Trace:
    zeros = ZeroLengths(path)
    requests: list[TraceRequest] = []
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(path, f"invalid JSON: {e.msg}", line=lineno) from None
            try:
                requests.append(_parse(obj, len(requests), zeros))
            except FieldError as e:
                raise TraceError(path, e.message, line=lineno, field=e.field) from None
    zeros.report()
    return Trace(path.stem, str(path), requests)


def _parse(obj: object, index: int, zeros: ZeroLengths) -> TraceRequest:
    if not isinstance(obj, dict):
        raise FieldError("request", f"expected a JSON object, got {obj!r}")
    for key in KEYS:
        if key not in obj:
            raise FieldError(key, "missing")
    input_len = parse_int("input_length", obj["input_length"], minimum=0, what=_COUNT)
    blocks = parse_block_ids("hash_ids", obj.get("hash_ids", []))
    check_blocks_fit("hash_ids", len(blocks), BLOCK_SIZE, max(input_len, 1))
    return TraceRequest(
        id=f"r{index}",
        arrival=parse_seconds("timestamp", obj["timestamp"], per_second=1000),
        prompt_len=zeros.prompt_len(input_len),
        output_len=zeros.output_len(
            parse_int("output_length", obj["output_length"], minimum=0, what=_COUNT)
        ),
        prefix_blocks=blocks,
        prefix_block_size=BLOCK_SIZE if blocks else 0,
    )
