"""AsyncEngine: the engine loop in its own thread, beside the HTTP server's event loop.

The HTTP handlers run on asyncio; the engine (`ServedModel.step`: EngineCore.step, or
the simulated twin's paced step) runs in one thread that owns every engine object.
They meet in two queues, so neither blocks the other:

  handlers -> engine   a deque of commands (add a request's prompts, abort them), drained
                       between steps; the thread sleeps on an Event while idle.
  engine -> handlers   per HTTP request an asyncio.Queue of events, filled by
                       `loop.call_soon_threadsafe` once per step: first "admitted" or
                       "rejected" (the engine's reason, a 400), then "deltas" (each
                       completion's new text, tokens and logprobs, and its finish) and
                       "done" once every completion has finished, or "failed" when the
                       engine loop itself raised.

Every hand-over to the event loop carries the scheduler's waiting count of that moment,
and the loop updates it together with the count of requests on their way in, so
`num_waiting` (what --max-waiting bounds) never misses an admitted request. An error
outside a step (a bug in the thread's own code) ends the thread: every live request
fails with it, and `error` says so (/health answers 503).

Request objects never cross: the engine thread detokenizes (stop strings end a request
there) and sends immutable `Delta`s. Async scheduling is untouched: the thread calls the
engine's own step. Records of ended requests go to the server's metrics and are
dropped, so a long-running server holds no per-request state once a request ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from deepinfer.entrypoints.openai.served_model import ServedModel
from deepinfer.entrypoints.openai.server_metrics import ServerMetrics
from deepinfer.output_processor import TrackedCompletion, TrackedPrompt
from deepinfer.outputs import TokenLogprob
from deepinfer.request import FinishReason, Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delta:
    """What one step added to one completion."""

    prompt: int  # the prompt's index in the HTTP request
    index: int  # the completion's index among the prompt's n
    text: str
    token_ids: list[int]
    logprobs: list[list[TokenLogprob]] | None  # per new token: [chosen, top 1..k]
    finish_reason: str | None = None  # set once, on the completion's last delta
    stop_reason: int | str | None = None
    error: str | None = None  # why the engine ended it (a failed step, a failed grammar)


class RequestHandle:
    """One HTTP request's prompts in the engine, seen from the event loop."""

    def __init__(self, request_id: str, prompts: list[TrackedPrompt]) -> None:
        self.request_id = request_id
        self.prompts = prompts  # owned by the engine thread once submitted
        self.num_prompt_tokens = [len(p.prompt_token_ids) for p in prompts]
        self.num_requests = sum(len(p.completions) for p in prompts)
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.finished = False  # every completion has ended (or the request was refused)
        self.num_live = self.num_requests  # completions not yet ended (event loop's count)

    async def admitted(self) -> str | None:
        """None once the engine queued every completion, else its rejection reason;
        RuntimeError when the engine loop failed."""
        kind, value = await self.events.get()
        if kind == "admitted":
            return None
        self.finished = True
        if kind == "failed":
            raise RuntimeError(value)
        return str(value)

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """Each step's deltas until every completion has finished; RuntimeError when the
        engine loop failed."""
        while True:
            kind, value = await self.events.get()
            if kind == "done":
                break
            if kind == "failed":
                self.finished = True
                raise RuntimeError(value)
            yield value
        self.finished = True


class AsyncEngine:
    """The engine thread and the queues to it (see the module docstring)."""

    def __init__(self, served: ServedModel, metrics: ServerMetrics) -> None:
        self.served = served
        self.metrics = metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: deque[tuple[str, RequestHandle]] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        # Engine thread: req_id -> (its handle, prompt index, completion, tokens sent).
        self._live: dict[str, tuple[RequestHandle, int, TrackedCompletion]] = {}
        self._sent: dict[str, int] = {}
        self._admitting: RequestHandle | None = None  # engine thread: the one being added
        # Event loop side: both change together, in `_deliver`.
        self._unadmitted = 0  # engine requests submitted, not yet admitted
        self._engine_waiting = 0  # the scheduler's waiting queue at the last hand-over
        self._open: set[RequestHandle] = set()  # submitted, some completion not ended
        self.error: str | None = None  # why the engine thread died (set on the loop)
        self.draining = False  # shutting down: no request is admitted
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        """Engine requests waiting: in the scheduler's queue or on their way to it."""
        return self._unadmitted + self._engine_waiting

    def next_id(self) -> str:
        return f"{next(self._ids)}"

    def submit(self, handle: RequestHandle) -> None:
        """Queue `handle`'s completions (call from the event loop)."""
        if self.error is not None:
            raise RuntimeError(f"the engine loop died: {self.error}")
        self._unadmitted += handle.num_requests
        self._open.add(handle)
        self._command("add", handle)

    def abort(self, handle: RequestHandle) -> None:
        """End `handle`'s live completions and free their blocks (the client left); each
        still sends its last delta (finish_reason "abort") to whoever reads."""
        if not handle.finished:
            handle.finished = True
            self._command("abort", handle)

    async def drain(self, timeout: float) -> None:
        """Admit nothing more; let the live requests run up to `timeout` seconds, then
        abort the rest (their streams end with finish_reason "abort")."""
        self.draining = True
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self._open and loop.time() < end:
            await asyncio.sleep(0.05)
        if self._open:
            logger.warning("drain: aborting %d requests after %.1f s", len(self._open), timeout)
        for handle in list(self._open):
            self.abort(handle)
        while self._open and self.error is None and loop.time() < end + 5.0:
            await asyncio.sleep(0.01)  # their last deltas reach their responses

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        self.served.shutdown()

    def _command(self, kind: str, handle: RequestHandle) -> None:
        self._commands.append((kind, handle))
        self._wake.set()

    # ---- the engine thread -----------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._iterate()
        except BaseException as e:  # a bug outside a step: nothing can be trusted now
            logger.exception("the engine loop died")
            self._die(f"{type(e).__name__}: {e}")

    def _iterate(self) -> None:
        engine = self.served.engine
        self._wake.clear()
        self._drain()
        if not engine.has_unfinished():
            self._publish([])
            self._wake.wait()
            return
        try:
            changed = self.served.step()
        except Exception as e:  # a failed step: fail what runs, keep serving
            logger.exception("an engine step failed")
            self._fail_all(f"{type(e).__name__}: {e}")
            return
        self._publish(self._deltas(changed))

    def _drain(self) -> None:
        while self._commands:
            kind, handle = self._commands.popleft()
            if kind == "add":
                self._admitting = handle
                self._admit(handle)
                self._admitting = None
                continue
            ended = []
            for p, prompt in enumerate(handle.prompts):
                for c in prompt.completions:
                    rid = c.req.request_id
                    if rid in self._live:
                        self.served.engine.abort(rid)
                        last = self._delta(p, c)
                        if last.finish_reason is None:  # (the scheduler no longer held it)
                            self._end(rid)
                            last = dataclasses.replace(last, finish_reason="abort")
                        ended.append(last)
            if ended:
                self._post([(handle, ("deltas", ended))])

    def _admit(self, handle: RequestHandle) -> None:
        engine = self.served.engine
        added: list[str] = []
        for p, prompt in enumerate(handle.prompts):
            for c in prompt.completions:
                reason = engine.add_request(c.req)
                if reason is not None:
                    for rid in added:
                        self._end(rid)
                        engine.abort(rid)
                    self._post([(handle, ("rejected", reason))])
                    return
                rid = c.req.request_id
                self._live[rid] = (handle, p, c)
                self._sent[rid] = 0
                added.append(rid)
        self._post([(handle, ("admitted", None))])

    def _deltas(self, changed: list[Request]) -> list[tuple[RequestHandle, tuple[str, Any]]]:
        """Each handle's deltas of the step (a stop string found ends its request here)."""
        out: dict[RequestHandle, list[Delta]] = {}
        for req in changed:
            entry = self._live.get(req.request_id)
            if entry is None:
                continue
            handle, p, c = entry
            if c.feed():  # a stop string ended the text
                if not req.is_finished:
                    self.served.engine.finish(req.request_id, FinishReason.STOP)
                else:  # the engine ended it on a later token of this update
                    self.served.engine.restate_record(req)
            out.setdefault(handle, []).append(self._delta(p, c))
        return [(h, ("deltas", ds)) for h, ds in out.items()]

    def _delta(self, p: int, c: TrackedCompletion) -> Delta:
        req = c.req
        rid = req.request_id
        sent = self._sent[rid]
        tokens = req.output_token_ids[sent:]
        self._sent[rid] = sent + len(tokens)
        logprobs = None
        if req.sampling_params.logprobs is not None:
            logprobs = list(req.logprobs[sent : sent + len(tokens)])
        text = c.take_new_text()
        if not req.is_finished:
            return Delta(p, c.index, text, list(tokens), logprobs)
        self._end(rid)
        reason = req.finish_reason.value if req.finish_reason is not None else "abort"
        error = req.reject_reason if reason in ("abort", "rejected") else None
        return Delta(p, c.index, text, list(tokens), logprobs, reason, c.stop_reason(), error)

    def _end(self, rid: str) -> None:
        self._live.pop(rid, None)
        self._sent.pop(rid, None)

    def _fail_all(self, error: str) -> None:
        engine = self.served.engine
        handles = {h for h, _, _ in self._live.values()}
        for rid in list(self._live):
            self._end(rid)
            engine.abort(rid)
        engine.discard_in_flight()
        self._post([(h, ("failed", error)) for h in handles])

    def _die(self, error: str) -> None:
        """The thread's last act: every request it holds fails with `error`; the event
        loop fails those still on their way in."""
        handles = {h for h, _, _ in self._live.values()}
        if self._admitting is not None:
            handles.add(self._admitting)
        for rid in list(self._live):
            try:  # (end their records as aborted, if the engine still can)
                self.served.engine.abort(rid)
            except Exception:
                logger.debug("could not abort %s", rid, exc_info=True)
        self._live.clear()
        self._sent.clear()
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # (a closed loop: the server is going down)
            self._loop.call_soon_threadsafe(self._died, error, handles)

    def _publish(self, events: list[tuple[RequestHandle, tuple[str, Any]]]) -> None:
        """Hand ended requests' records to the metrics (and drop them), the state, then
        the step's events (after the state: a client that reads them sees this step)."""
        engine = self.served.engine
        if engine.records:
            records, engine.records = engine.records, []
            self.metrics.observe(records)
        s = engine.scheduler
        self.metrics.set_state(s.num_running, s.num_waiting, s.kv.usage, s.num_preemptions)
        self._post(events)

    def _post(self, items: list[tuple[RequestHandle, tuple[str, Any]]]) -> None:
        assert self._loop is not None
        waiting = self.served.engine.scheduler.num_waiting
        try:
            self._loop.call_soon_threadsafe(self._deliver, items, waiting)
        except RuntimeError:  # the event loop has closed: the server is going down
            logger.debug("dropped %d events: the event loop is closed", len(items))

    # ---- the event loop --------------------------------------------------------------

    def _deliver(self, items: list[tuple[RequestHandle, tuple[str, Any]]], waiting: int) -> None:
        """Hand each event to its request; `waiting` is the scheduler's count once the
        engine thread made them (admissions included)."""
        self._engine_waiting = waiting
        for handle, event in items:
            kind, value = event
            handle.events.put_nowait(event)
            if kind in ("admitted", "rejected"):
                self._unadmitted -= handle.num_requests
            if kind == "deltas":
                handle.num_live -= sum(1 for d in value if d.finish_reason is not None)
                if handle.num_live == 0:
                    handle.events.put_nowait(("done", None))
            if kind in ("rejected", "failed") or handle.num_live == 0:
                self._open.discard(handle)

    def _died(self, error: str, handles: set[RequestHandle]) -> None:
        """The engine thread is gone: fail what it held and what it never took."""
        self.error = error
        while self._commands:
            kind, handle = self._commands.popleft()
            if kind == "add":
                self._unadmitted -= handle.num_requests
                handles.add(handle)
        for handle in handles:
            handle.events.put_nowait(("failed", error))
            self._open.discard(handle)
