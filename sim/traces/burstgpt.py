"""BurstGPT traces: CSV `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`.

`Timestamp` is seconds since the trace start and is kept as it is. BurstGPT
marks a failed request with 0 response tokens: it never generated, so
replaying it as a served request would add load the service did not carry.
Those rows are skipped (with one logged warning giving the count); request
ids still follow the file's row order, so `r{i}` always names data row i.
"""

from __future__ import annotations

from pathlib import Path

from sim.traces.fields import FieldError, ZeroLengths, logger, parse_int, parse_seconds, read_csv
from sim.traces.model import Trace, TraceError, TraceRequest

COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
_COUNT = "a non-negative integer"


def load_burstgpt(path: Path) -> Trace:
    zeros = ZeroLengths(path)
    requests: list[TraceRequest] = []
    failed = 0
    for i, (lineno, (stamp, req_tokens, resp_tokens)) in enumerate(read_csv(path, COLUMNS)):
        try:
            arrival = parse_seconds("Timestamp", stamp)
            prompt_len = parse_int("Request tokens", req_tokens, minimum=0, what=_COUNT)
            output_len = parse_int("Response tokens", resp_tokens, minimum=0, what=_COUNT)
        except FieldError as e:
            raise TraceError(path, e.message, line=lineno, field=e.field) from None
        if output_len == 0:
            failed += 1
            continue
        requests.append(
            TraceRequest(
                id=f"r{i}",
                arrival=arrival,
                prompt_len=zeros.prompt_len(prompt_len),
                output_len=output_len,
            )
        )
    if failed:
        logger.warning("%s: skipped %d failed requests (Response tokens 0)", path, failed)
    zeros.report()
    return Trace(path.stem, str(path), requests)
