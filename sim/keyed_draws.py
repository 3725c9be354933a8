"""Random numbers fixed by a key: the same key gives the same number on every machine
and Python (unlike `hash`), whatever order the keys are asked in.

The simulator's executor draws a draft's acceptance from (seed, request, position), and
the noisy cost model a step's time from (seed, step id): a step priced alone or as part
of a fast-forwarded decode run gets the same draw, so the two paths stay equal to the
bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from statistics import NormalDist

_MASK = (1 << 64) - 1
_STANDARD = NormalDist()


def unit_draw(key: Iterable[int]) -> float:
    """A number in [0, 1) fixed by `key`, the integers folded through splitmix64's
    finaliser."""
    z = 0x9E3779B97F4A7C15
    for part in key:
        z = (z ^ (part & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
        z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def normal_draw(key: Iterable[int]) -> float:
    """A standard normal number fixed by `key` (the inverse CDF of `unit_draw`, moved off
    0 by half a step of its grid so that it is finite)."""
    return _STANDARD.inv_cdf(unit_draw(key) + 2.0**-54)
