"""Per-module counts of a mutmut run, from `mutmut results --all true` (one mutant a line,
`NAME: STATUS`), as the markdown table tests/property/MUTATION.md keeps.

    python tests/property/mutation_counts.py RESULTS.txt

A module's score is its killed mutants over those checked (a timeout counts as killed, as
mutmut counts it; "no tests" counts as a survivor: no property reaches the code).
"""

from __future__ import annotations

import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

# deepinfer.routing.policies.xǁRoundRobinǁroute__mutmut_3 / ....x_function__mutmut_12
_NAME = re.compile(r"^\s*(?P<module>[\w.]+?)\.x(?:ǁ|_)\S*__mutmut_\d+:\s*(?P<status>.+?)\s*$")


def counts(lines: list[str]) -> dict[str, Counter[str]]:
    by_module: dict[str, Counter[str]] = defaultdict(Counter)
    for line in lines:
        m = _NAME.match(line)
        if m:
            by_module[m["module"]][m["status"]] += 1
    return by_module


def table(by_module: dict[str, Counter[str]]) -> str:
    rows = [
        "| module | mutants | killed | survived | no tests | timeout | not checked | score |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for module in sorted(by_module):
        c = by_module[module]
        total = sum(c.values())
        killed, timeout = c["killed"], c["timeout"]
        unchecked = c["not checked"]
        checked = total - unchecked
        score = f"{(killed + timeout) / checked:.1%}" if checked else "-"
        rows.append(
            f"| {module} | {total} | {killed} | {c['survived']} | {c['no tests']} | "
            f"{timeout} | {unchecked} | {score} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(table(counts(Path(sys.argv[1]).read_text().splitlines())))
