"""DataParallelEngine: the front-end over N ranks, each an EngineCore of its own.

It has EngineCore's request interface (`add_request`, `step`, `finish`, `abort`,
`has_unfinished`), so `LLM` drives it unchanged. A request goes to the rank the router
(deepinfer.routing, by name) picks from the ranks' replies, and stays there; the front-end keeps its own copy of every live request,
updated from the ranks' deltas after each step. Every step is one round on every rank
at once (expert-parallel ranks must run their MoE layers together).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

from deepinfer.data_parallel.protocol import RankClient, RankInfo, StepCommand, StepReply, Stop
from deepinfer.data_parallel.request_sync import apply_delta
from deepinfer.request import FinishReason, Request, RequestStatus
from deepinfer.routing import InstanceView, make_router
from deepinfer.routing.instance_report import InstanceReport, take_report


class RankFailed(RuntimeError):
    """A rank's step raised; the message carries the rank's traceback."""


class DataParallelEngine:
    def __init__(
        self,
        ranks: Sequence[RankClient],
        infos: Sequence[RankInfo],
        *,
        clock: Callable[[], float] = time.monotonic,
        router: str = "least-load",
        seed: int = 0,
    ) -> None:
        self.ranks = list(ranks)
        self.infos = list(infos)
        self.clock = clock
        self.router = make_router(router, len(self.ranks), seed=seed)
        self.views = [InstanceView(i.rank, i.block_size, i.max_prompt_tokens) for i in infos]
        self.max_model_len = min(i.max_model_len for i in self.infos)
        self.requests: dict[str, Request] = {}  # live requests, the front-end's copies
        self.rank_of: dict[str, int] = {}
        self._commands = [StepCommand() for _ in self.ranks]
        self.num_steps = 0
        self.on_shutdown: Callable[[], None] | None = None  # the launcher joins its ranks
        self._unanswered: list[int] = []  # ranks whose reply an interrupted step left unread
        self._received: list[StepReply] = []  # replies read but not applied yet

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def add_request(self, req: Request) -> str | None:
        """Place `req` on the balancer's rank. It is sent with the next step, so a
        rejection (prompt too long for a rank's cache) comes back from that step."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already live")
        rank = self.router.route(req, self.views)
        self.requests[req.request_id] = req
        self.rank_of[req.request_id] = rank
        self._commands[rank].adds.append(req)
        return None

    def finish(self, req_id: str, reason: FinishReason) -> Request | None:
        """End a live request here at once and on its rank with the next step."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        rank = self.rank_of.pop(req_id)
        self.router.on_finished(req_id, rank)
        cmd = self._commands[rank]
        if req in cmd.adds:  # never sent: the rank need not hear of it
            cmd.adds.remove(req)
        else:
            cmd.finishes.append((req_id, reason))
        aborted = reason is FinishReason.ABORT
        req.status = RequestStatus.ABORTED if aborted else RequestStatus.FINISHED
        req.finish_reason = reason
        req.times.finish = self.clock()
        return req

    def abort(self, req_id: str) -> Request | None:
        return self.finish(req_id, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def discard_in_flight(self) -> None:
        """Steps are synchronous: nothing is ever left in flight."""

    def step(self) -> list[Request]:
        """One step on every rank; returns the requests that changed (RankFailed if a
        rank's step raised: its error and traceback, once every rank has answered)."""
        changed = self._apply(self._receive())  # an interrupted step's replies, first
        commands, self._commands = self._commands, [StepCommand() for _ in self.ranks]
        for conn, cmd in zip(self.ranks, commands):
            conn.send(cmd)
        self._unanswered = list(range(self.num_ranks))
        replies = self._receive()
        self.num_steps += 1
        return changed + self._apply(replies)

    def _receive(self) -> list[StepReply]:
        """The replies still owed; an interruption (Ctrl-C) leaves the rest owed, so the
        ranks and the front-end never fall out of step."""
        while self._unanswered:
            self._received.append(self.ranks[self._unanswered[0]].recv())
            self._unanswered.pop(0)
        replies, self._received = self._received, []
        return replies

    def _apply(self, replies: list[StepReply]) -> list[Request]:
        changed: list[Request] = []
        for reply in replies:
            ended: list[str] = []
            for d in reply.deltas:
                req = self.requests.get(d.req_id)
                if req is None:  # ended here meanwhile (a stop string, an abort)
                    continue
                apply_delta(req, d)
                if req.is_finished:
                    del self.requests[d.req_id]
                    del self.rank_of[d.req_id]
                    ended.append(d.req_id)
                changed.append(req)
            report = InstanceReport(reply.rank, reply.load, reply.cache_changes, tuple(ended))
            take_report(self.router, self.views, report)
        failed = [r for r in replies if r.error is not None]
        if failed:
            r = failed[0]
            raise RankFailed(
                f"data-parallel rank {r.rank}: {type(r.error).__name__}: {r.error}\n{r.error_text}"
            ) from r.error
        return changed

    def shutdown(self) -> None:
        for conn in self.ranks:
            with contextlib.suppress(BrokenPipeError, OSError):  # that rank is gone already
                conn.send(Stop())
        if self.on_shutdown is not None:
            self.on_shutdown()
            self.on_shutdown = None
