"""Field parsing shared by the loaders.

Parsers raise `FieldError(field, message)`, which knows nothing of files; each
loader wraps it into a `TraceError` with the path and line it is reading, so
every message names file, line and field without threading them through here.
"""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

from sim.traces.model import TraceError

logger = logging.getLogger("sim.traces")


class FieldError(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.field = field
        self.message = message


def parse_int(field: str, value: object, *, minimum: int | None, what: str) -> int:
    """An integer (>= minimum unless that is None) from a JSON number or CSV text.

    Integral floats ("512.0") pass: converters written with pandas emit them.
    Booleans do not (True is an int to Python, never a token count to a user).
    """
    if type(value) is int:
        result = value
    elif isinstance(value, float) and value.is_integer():
        result = int(value)
    elif isinstance(value, str):
        try:
            result = int(value)
        except ValueError:
            try:
                f = float(value)
            except ValueError:
                raise FieldError(field, f"expected {what}, got {value!r}") from None
            if not f.is_integer():
                raise FieldError(field, f"expected {what}, got {value!r}") from None
            result = int(f)
    else:
        raise FieldError(field, f"expected {what}, got {value!r}")
    if minimum is not None and result < minimum:
        raise FieldError(field, f"expected {what}, got {value!r}")
    return result


def parse_seconds(field: str, value: object, *, per_second: int = 1) -> float:
    """A finite, non-negative time in units of 1/`per_second` s, returned in seconds.

    Dividing (not multiplying by 1e-3) keeps 27482 ms at exactly 27.482 s.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise FieldError(field, f"expected a non-negative number, got {value!r}")
    try:
        t = float(value)
    except ValueError:
        raise FieldError(field, f"expected a non-negative number, got {value!r}") from None
    if not math.isfinite(t) or t < 0:
        raise FieldError(field, f"expected a finite non-negative number, got {value!r}")
    return t / per_second if per_second != 1 else t


def parse_block_ids(field: str, value: object) -> tuple[int, ...]:
    """A JSON list of integer block ids."""
    if not isinstance(value, list):
        raise FieldError(field, f"expected a list of integers, got {value!r}")
    for i, v in enumerate(value):
        if type(v) is not int:
            raise FieldError(field, f"expected a list of integers, item {i} is {v!r}")
    return tuple(value)


def check_blocks_fit(field: str, n_blocks: int, block_size: int, prompt_len: int) -> None:
    """Prefix blocks must lie inside the prompt (the last may be partial)."""
    if n_blocks and (n_blocks - 1) * block_size >= prompt_len:
        raise FieldError(
            field,
            f"{n_blocks} blocks of {block_size} tokens do not fit a prompt of "
            f"{prompt_len} tokens (at most {math.ceil(prompt_len / block_size)})",
        )


def read_csv(path: Path, columns: Sequence[str]) -> Iterator[tuple[int, list[str]]]:
    """Yield (line number, values of `columns`) for each data row of a CSV file.

    Columns are found by header name, so extra or reordered columns are fine.
    Blank lines are skipped. The line number is csv's physical line, which is
    what an editor shows even when a quoted field spans lines.
    """
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceError(path, "empty file, expected a CSV header")
        names = [h.strip() for h in header]
        index: list[int] = []
        for col in columns:
            if col not in names:
                raise TraceError(
                    path, f"missing column (header: {','.join(names)})", line=1, field=col
                )
            index.append(names.index(col))
        last = max(index)
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) <= last:
                missing = next(c for c, i in zip(columns, index) if i >= len(row))
                raise TraceError(
                    path,
                    f"missing value (row has {len(row)} columns)",
                    line=reader.line_num,
                    field=missing,
                )
            yield reader.line_num, [row[i].strip() for i in index]


class ZeroLengths:
    """Counts rows whose zero lengths were replayed as 1, and says so once per file.

    Public traces record what production saw: a request may have produced no
    output (or, rarely, had an empty prompt). The engine always computes at
    least one prompt token and samples at least one token, so such a row is
    replayed as 1 token rather than dropped: its arrival and prefill load stay
    in the workload, which is what these traces are for.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.prompt = 0
        self.output = 0

    def prompt_len(self, n: int) -> int:
        if n == 0:
            self.prompt += 1
            return 1
        return n

    def output_len(self, n: int) -> int:
        if n == 0:
            self.output += 1
            return 1
        return n

    def report(self) -> None:
        if self.prompt or self.output:
            logger.warning(
                "%s: replayed %d zero-length prompts and %d zero-length outputs as 1 token",
                self.path,
                self.prompt,
                self.output,
            )
