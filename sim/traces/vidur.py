"""Vidur request traces: CSV with `arrived_at` (s), `num_prefill_tokens`, `num_decode_tokens`.

This is what Vidur's trace-replay request generator reads (its
`data/processed_traces/*.csv`); extra columns are ignored. Vidur clips both
counts to at least 1, and so do we (see `ZeroLengths`), so a Vidur trace
replays here with the same sizes it has there. Length-only Vidur files
(no `arrived_at`) carry no arrivals and are refused.
"""

from __future__ import annotations

from pathlib import Path

from sim.traces.fields import FieldError, ZeroLengths, parse_int, parse_seconds, read_csv
from sim.traces.model import Trace, TraceError, TraceRequest

COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
_COUNT = "a non-negative integer"


def load_vidur(path: Path) -> Trace:
    zeros = ZeroLengths(path)
    requests: list[TraceRequest] = []
    for i, (lineno, (arrived, prefill, decode)) in enumerate(read_csv(path, COLUMNS)):
        try:
            arrival = parse_seconds("arrived_at", arrived)
            prompt_len = parse_int("num_prefill_tokens", prefill, minimum=0, what=_COUNT)
            output_len = parse_int("num_decode_tokens", decode, minimum=0, what=_COUNT)
        except FieldError as e:
            raise TraceError(path, e.message, line=lineno, field=e.field) from None
        requests.append(
            TraceRequest(
                id=f"r{i}",
                arrival=arrival,
                prompt_len=zeros.prompt_len(prompt_len),
                output_len=zeros.output_len(output_len),
            )
        )
    zeros.report()
    return Trace(path.stem, str(path), requests)
