"""Azure LLM inference traces (2023 and 2024): CSV `TIMESTAMP,ContextTokens,GeneratedTokens`.

TIMESTAMP is absolute wall time with up to 7 fractional digits
(`2023-11-16 18:17:03.9799600`), sometimes with a UTC offset. Arrival is
seconds since the earliest row. Times are kept as integer nanoseconds until
the subtraction: a float of seconds since an epoch (~1e9 s or more) cannot
hold 100 ns resolution.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

from sim.traces.fields import FieldError, ZeroLengths, parse_int, read_csv
from sim.traces.model import Trace, TraceError, TraceRequest

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_COUNT = "a non-negative integer"

_TIMESTAMP = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"\s*(Z|[+-]\d{2}:?\d{2})?"
)


def parse_timestamp_ns(text: str) -> int:
    """Nanoseconds since 0001-01-01 UTC of an Azure TIMESTAMP."""
    m = _TIMESTAMP.fullmatch(text)
    if m is None:
        raise FieldError("TIMESTAMP", f"expected 'YYYY-MM-DD hh:mm:ss[.fffffff]', got {text!r}")
    year, month, day, hh, mi, ss, frac, tz = m.groups()
    try:
        days = dt.date(int(year), int(month), int(day)).toordinal()
    except ValueError:
        raise FieldError("TIMESTAMP", f"invalid date in {text!r}") from None
    if int(hh) > 23 or int(mi) > 59 or int(ss) > 60:
        raise FieldError("TIMESTAMP", f"invalid time of day in {text!r}")
    secs = days * 86400 + int(hh) * 3600 + int(mi) * 60 + int(ss)
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        secs -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    ns = int((frac or "").ljust(9, "0"))
    return secs * 1_000_000_000 + ns


def load_azure(path: Path) -> Trace:
    zeros = ZeroLengths(path)
    rows: list[tuple[int, int, int]] = []  # (ns, prompt_len, output_len)
    for lineno, (stamp, context, generated) in read_csv(path, COLUMNS):
        try:
            ns = parse_timestamp_ns(stamp)
            prompt_len = parse_int("ContextTokens", context, minimum=0, what=_COUNT)
            output_len = parse_int("GeneratedTokens", generated, minimum=0, what=_COUNT)
        except FieldError as e:
            raise TraceError(path, e.message, line=lineno, field=e.field) from None
        rows.append((ns, zeros.prompt_len(prompt_len), zeros.output_len(output_len)))
    zeros.report()
    t0 = min((r[0] for r in rows), default=0)
    requests = [
        TraceRequest(id=f"r{i}", arrival=(ns - t0) / 1e9, prompt_len=p, output_len=o)
        for i, (ns, p, o) in enumerate(rows)
    ]
    return Trace(path.stem, str(path), requests)
