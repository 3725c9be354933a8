"""Draft acceptance in the simulator: one probability per draft position, measured.

`AcceptanceModel.per_position[j]` is the chance that draft j + 1 is accepted given
drafts 1..j were (verification stops at the first rejection), so the expected tokens
of a verify step with k drafts are 1 + sum_j prod_{i <= j} per_position[i]. A
model measured on a real checkpoint (`deepinfer measure-acceptance`, which runs the
torch executor over held-out text and writes these counts) lives in a small JSON file:

    {"version": 1, "model": "...", "source": "...", "num_speculative_tokens": 3,
     "reached": [n_1, n_2, n_3], "accepted": [a_1, a_2, a_3]}

`reached[j]`: verified drafts at position j + 1 whose drafts 1..j were all accepted;
`accepted[j]`: of them, accepted (Scheduler.draft_position_stats counts both).
Positions past the measured ones reuse the last probability.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).parent / "data" / "acceptance"


@dataclass(frozen=True)
class AcceptanceModel:
    per_position: tuple[float, ...]  # P(draft j + 1 accepted | drafts 1..j accepted)
    source: str = "fixed"

    def __post_init__(self) -> None:
        if not self.per_position:
            raise ValueError("an acceptance model needs at least one position")
        bad = [p for p in self.per_position if not 0.0 <= p <= 1.0]
        if bad:
            raise ValueError(f"acceptance probabilities must be in [0, 1], got {bad}")

    @classmethod
    def fixed(cls, rate: float) -> AcceptanceModel:
        return cls((rate,), f"fixed {rate}")

    def probability(self, position: int) -> float:
        """Chance that the draft at `position` (1-based) passes, given the earlier did."""
        return self.per_position[min(position, len(self.per_position)) - 1]

    def expected_tokens(self, k: int) -> float:
        """Expected tokens of a verify step with k drafts (accepted drafts plus one)."""
        total, reach = 1.0, 1.0
        for j in range(1, k + 1):
            reach *= self.probability(j)
            total += reach
        return total

    @classmethod
    def from_counts(
        cls, reached: list[int], accepted: list[int], source: str = "measured"
    ) -> AcceptanceModel:
        """Conditional probabilities from per-position counts (up to the first position
        never reached)."""
        probs = []
        for n, a in zip(reached, accepted):
            if not n:
                break
            probs.append(a / n)
        return cls(tuple(probs), source)

    @classmethod
    def load(cls, path: str | Path) -> AcceptanceModel:
        """An acceptance file (above), by path or by name under sim/data/acceptance/."""
        p = Path(path)
        if not p.is_file() and (DATA_DIR / f"{path}.json").is_file():
            p = DATA_DIR / f"{path}.json"
        try:
            data = json.loads(p.read_text())
            reached, accepted = list(data["reached"]), list(data["accepted"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a readable acceptance file ({e})") from None
        if len(reached) != len(accepted) or any(a > n for n, a in zip(reached, accepted)):
            raise ValueError(f"{path}: 'accepted' must pair with 'reached', each <= it")
        return cls.from_counts(reached, accepted, source=str(p))


def acceptance_file(
    model: str, source: str, k: int, reached: list[int], accepted: list[int]
) -> dict[str, Any]:
    """The JSON content of an acceptance file."""
    return {
        "version": 1,
        "model": model,
        "source": source,
        "num_speculative_tokens": k,
        "reached": reached,
        "accepted": accepted,
        "per_position": list(AcceptanceModel.from_counts(reached, accepted).per_position),
    }
