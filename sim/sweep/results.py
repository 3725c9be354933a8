"""The sweep's results: an append-only points file to resume from, and the final files.

`points.jsonl` starts with a header naming the sweep (trace content, seed, SLO); each
further line is one simulated point, written as soon as it finishes. A sweep started
again on the same directory takes the points already there instead of simulating them
again. A line cut short by a kill is skipped. The final files (`points.csv`,
`configs.csv`, `sweep.json`) are rewritten from scratch at the end, rows sorted, so
they are the same whatever ran the points and in what order they finished.
"""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path
from typing import IO, Any

from sim.sweep.point import SweepContext

FORMAT_VERSION = 1
POINTS_FILE = "points.jsonl"


def sweep_header(ctx: SweepContext) -> dict[str, Any]:
    """What a point's row depends on besides its config and rate."""
    sizes = [
        (r.prompt_len, r.output_len, r.prefix_blocks, r.prefix_block_size, r.priority)
        for r in ctx.trace.requests
    ]
    digest = hashlib.sha256(json.dumps(sizes).encode()).hexdigest()[:16]
    return {
        "format": FORMAT_VERSION,
        "trace": ctx.trace.name,
        "num_requests": len(ctx.trace),
        "trace_sha256": digest,
        "seed": ctx.seed,
        "slo": ctx.slo.text,
    }


class ResultStore:
    def __init__(self, out: Path, header: dict[str, Any], *, fresh: bool = False) -> None:
        self.out = out
        self.path = out / POINTS_FILE
        self.header = header
        out.mkdir(parents=True, exist_ok=True)
        if fresh and self.path.exists():
            self.path.unlink()
        self._file: IO[str] | None = None

    def load(self) -> dict[tuple[str, float], dict[str, Any]]:
        """Points of an earlier run of this same sweep, by (config key, rate)."""
        if not self.path.exists():
            return {}
        rows: dict[tuple[str, float], dict[str, Any]] = {}
        with self.path.open() as f:
            first = f.readline()
            try:
                header = json.loads(first).get("sweep")
            except json.JSONDecodeError:
                header = None
            if header is None and first.strip():
                raise ValueError(
                    f"{self.path}: not a sweep points file; pass --fresh or another --out"
                )
            if header is not None and header != self.header:
                diff = sorted(k for k in self.header if header.get(k) != self.header[k])
                raise ValueError(
                    f"{self.path}: holds a sweep with other {', '.join(diff)}; pass --fresh "
                    "to start over there, or another --out"
                )
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # the last line of a run that was killed while writing it
                rows[(row["config_key"], row["rate"])] = row
        return rows

    def append(self, row: dict[str, Any]) -> None:
        if self._file is None:
            new = not self.path.exists() or self.path.stat().st_size == 0
            self._file = self.path.open("a")
            if new:
                self._file.write(json.dumps({"sweep": self.header}) + "\n")
            elif not _ends_with_newline(self.path):
                self._file.write("\n")  # leave a cut line on its own, to be skipped
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()  # a kill loses at most the point being written

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def write_outputs(
    out: Path,
    header: dict[str, Any],
    configs: list[dict[str, Any]],
    points: list[dict[str, Any]],
) -> dict[str, Path]:
    """configs.csv (ranked), points.csv and sweep.json (both, with the header)."""
    paths = {
        "configs": out / "configs.csv",
        "points": out / "points.csv",
        "json": out / "sweep.json",
    }
    _write_csv(paths["configs"], configs)
    _write_csv(paths["points"], points)
    doc = {"sweep": header, "configs": configs, "points": points}
    paths["json"].write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    return paths


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns: list[str] = []
    for row in rows:  # the union of keys, in first-seen order: the same rows, the same header
        columns += [k for k in row if k not in columns and not isinstance(row[k], dict)]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: "" if row.get(k) is None else row.get(k) for k in columns})


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"
