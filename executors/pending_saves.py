"""Which host slots a save may still be writing: the host KV tier's saves cross the link on
a stream of their own, so a later load of a slot must wait for the save that writes it
(and for no other).

A fence is what marks a save's copies done: a CUDA event recorded on the save stream after
them (executors/host_kv_tier.py); anything with a done test in the tests. Per slot the
fence of the last save queued into it is kept until it is seen done: saves into one slot
are queued in order on one stream, so the last one's fence covers the earlier ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

F = TypeVar("F")


class PendingSaves(Generic[F]):
    """Per host slot, the fence of the last save queued into it, until it is done."""

    def __init__(self, is_done: Callable[[F], bool]) -> None:
        self._is_done = is_done  # never blocks (torch.cuda.Event.query)
        self._fence: dict[int, F] = {}  # slot -> the fence of the last save queued into it

    def __len__(self) -> int:
        """Slots whose last save was not yet seen done (an upper bound: a fence is tested
        only when a read of its slot asks)."""
        return len(self._fence)

    def saved(self, slots: Iterable[int], fence: F) -> None:
        """Saves into `slots` were queued, all done when `fence` is."""
        for slot in slots:
            self._fence[slot] = fence

    def fences(self, slots: Iterable[int]) -> list[F]:
        """What a read of `slots` must wait for: the distinct fences of the saves still
        writing any of them, in the order of `slots`; a fence seen done is forgotten."""
        out: list[F] = []
        for slot in slots:
            fence = self._fence.get(slot)
            if fence is None:
                continue
            if self._is_done(fence):
                del self._fence[slot]
            elif all(fence is not f for f in out):
                out.append(fence)
        return out
