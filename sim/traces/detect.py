"""Recognise a trace file's format from its first line, never from its name.

Suffixes lie (Azure and BurstGPT are both `.csv`; native and Mooncake both
`.jsonl`), but each format's header line or first object's keys are distinct.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from sim.traces.azure import COLUMNS as AZURE_COLUMNS
from sim.traces.burstgpt import COLUMNS as BURSTGPT_COLUMNS
from sim.traces.model import TraceError
from sim.traces.vidur import COLUMNS as VIDUR_COLUMNS

# CSV formats by the header columns that identify them.
_CSV_FORMATS = (
    ("azure", frozenset(AZURE_COLUMNS)),
    ("burstgpt", frozenset(BURSTGPT_COLUMNS)),
    ("vidur", frozenset(VIDUR_COLUMNS)),
)


def detect_format(path: str | Path) -> str:
    """The format name of a trace file: native, azure, mooncake, burstgpt or vidur."""
    path = Path(path)
    first = _first_line(path)
    if first.startswith("{"):
        try:
            obj = json.loads(first)
        except json.JSONDecodeError:
            # A JSON document spread over lines (pretty-printed, or our own
            # writer's `.json`): only the native format is a single document.
            return "native"
        if isinstance(obj, dict):
            if {"requests", "prompt_len", "version"} & obj.keys():
                return "native"
            if {"input_length", "hash_ids"} & obj.keys():
                return "mooncake"
        raise TraceError(
            path,
            f"cannot detect the trace format from the first object's keys "
            f"{sorted(obj) if isinstance(obj, dict) else obj!r}; pass format= (--format on the command line)",
        )
    header = {h.strip() for h in next(csv.reader([first]), [])}
    for name, columns in _CSV_FORMATS:
        if columns <= header:
            return name
    raise TraceError(
        path,
        f"cannot detect the trace format from its first line "
        f"{first[:120]!r}; pass format= (--format on the command line): native, azure, mooncake, burstgpt or vidur",
    )


def _first_line(path: Path) -> str:
    with open(path, encoding="utf-8-sig") as f:
        for line in f:
            if line.strip():
                return line.strip()
    raise TraceError(path, "empty file")
