"""The waiting queue: in-progress chunked prefills first, then the rest.

A chunked prefill between chunks holds the blocks of its whole prompt, so it
must stay at the very front: nothing that arrives or is preempted later may
get ahead of it (otherwise its reserved blocks could keep the engine above the
prefill watermark while the request in front of it waits for room forever).

A request whose grammar is still compiling (`awaiting_grammar`) keeps its place but
is passed over by `peek` and `pop`: the requests behind it start meanwhile, and it
starts, from where it stands, once its grammar is ready. So is a decode engine's request
whose blocks are reserved and whose prompt's KV has not arrived yet (`awaiting_kv`, in
progress: it holds its blocks).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from deepinfer.request import Request


class WaitingQueue:
    def __init__(self, policy: str = "fcfs") -> None:
        self.policy = policy
        self._in_progress: deque[Request] = deque()  # chunked prefills holding blocks
        self._fcfs: deque[Request] = deque()
        self._by_priority: list[tuple[tuple[int, float, int], Request]] = []

    def __len__(self) -> int:
        return len(self._in_progress) + len(self._fcfs) + len(self._by_priority)

    def __iter__(self) -> Iterator[Request]:
        yield from self._in_progress
        yield from self._fcfs
        for _, req in self._by_priority:
            yield req

    @property
    def num_in_progress(self) -> int:
        return len(self._in_progress)

    def peek(self) -> Request | None:
        """The first request that may start now (in-progress prefills never await a grammar)."""
        for req in self._in_progress:
            if not req.awaiting_kv:
                return req
        for req in self._fcfs:  # the head, unless it awaits its grammar
            if not req.awaiting_grammar:
                return req
        for _, req in self._by_priority:
            if not req.awaiting_grammar:
                return req
        return None

    def pop(self) -> Request:
        """Remove and return what `peek` returns."""
        if self._in_progress:
            if not self._in_progress[0].awaiting_kv:
                return self._in_progress.popleft()
        elif self._fcfs and not self._fcfs[0].awaiting_grammar:
            return self._fcfs.popleft()
        req = self.peek()
        if req is None:
            raise IndexError("pop from a waiting queue with no request ready to start")
        self.remove(req)
        return req

    def add(self, req: Request) -> None:
        """A new arrival: FCFS order, or (priority, arrival) order."""
        if self.policy == "priority":
            key = (req.priority, req.arrival_time, req.uid)
            bisect.insort(self._by_priority, (key, req), key=lambda item: item[0])
        else:
            self._fcfs.append(req)

    def add_in_progress(self, req: Request) -> None:
        """A chunked prefill between chunks: back to the very front."""
        self._in_progress.appendleft(req)

    def add_preempted(self, req: Request) -> None:
        """A preempted request: ahead of new arrivals, behind in-progress prefills."""
        if self.policy == "priority":
            self.add(req)
        else:
            self._fcfs.appendleft(req)

    def remove(self, req: Request) -> bool:
        for q in (self._in_progress, self._fcfs):
            try:
                q.remove(req)
                return True
            except ValueError:
                pass
        for i, (_, r) in enumerate(self._by_priority):
            if r is req:
                del self._by_priority[i]
                return True
        return False
