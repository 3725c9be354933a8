"""The trace data model: what every loader produces, whatever the file format."""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter
from os import PathLike


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, described by sizes only (no text).

    `prefix_blocks` name the prompt's leading blocks of `prefix_block_size`
    tokens each: equal ids mean equal content, across requests, so the
    simulator's prefix cache sees the reuse the trace recorded. The last
    block may be partial (it ends where the prompt ends).
    """

    id: str
    arrival: float  # seconds from the trace start
    prompt_len: int
    output_len: int
    prefix_blocks: tuple[int, ...] = ()
    prefix_block_size: int = 0
    priority: int = 0
    structured: bool = False  # its output is constrained by a grammar (so_args): masks priced


@dataclass
class Trace:
    """A named list of requests, kept sorted by arrival (stable, so ties keep file order)."""

    name: str
    source: str
    requests: list[TraceRequest]

    def __post_init__(self) -> None:
        # Timsort is linear on already-sorted input, so this costs nothing for
        # the usual (sorted) file and makes the ordering an invariant.
        self.requests = sorted(self.requests, key=attrgetter("arrival"))

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration(self) -> float:
        """Seconds from the first arrival to the last (0.0 for fewer than two requests)."""
        if not self.requests:
            return 0.0
        return self.requests[-1].arrival - self.requests[0].arrival

    def with_all_structured(self) -> Trace:
        """The same requests, each with a structured output (its token masks priced)."""
        return Trace(self.name, self.source, [replace(r, structured=True) for r in self.requests])


class TraceError(ValueError):
    """A trace file that cannot be read; the message names file, line and field.

    Format: ``path:line: field 'name': message``; the line (1-based, as an
    editor shows it) and the field are left out only when they do not apply
    (e.g. a file whose format cannot be recognised).
    """

    def __init__(
        self,
        path: str | PathLike[str],
        message: str,
        *,
        line: int | None = None,
        field: str | None = None,
    ) -> None:
        self.path = str(path)
        self.line = line
        self.field = field
        self.message = message
        where = self.path if line is None else f"{self.path}:{line}"
        what = message if field is None else f"field {field!r}: {message}"
        super().__init__(f"{where}: {what}")

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only arguments do not survive the default exception pickling.
        return (_rebuild_error, (self.path, self.message, self.line, self.field))


def _rebuild_error(path: str, message: str, line: int | None, field: str | None) -> TraceError:
    return TraceError(path, message, line=line, field=field)
