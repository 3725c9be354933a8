"""DisaggregatedEngine: prefill engines and decode engines in one process, behind the
cluster routers, each request handed over with its prompt's KV (docs/design.md,
"Clusters": the simulator's handover rules, run for real).

It has EngineCore's request interface (`add_request`, `step`, `finish`, `abort`,
`has_unfinished`, `discard_in_flight`), so `LLM` drives it unchanged. A request goes, as
a copy, to the engine the prefill router picks. When that engine (role prefill) ends
the copy at its first token, its executor exports the KV of the prompt but its last token
(`Executor.export_kv`), the decode router picks a decode engine, the caller's request
itself joins it and that engine's executor imports the KV (`Executor.import_kv`): role
decode counts the prompt as computed and computes its last token again, which samples
the first output token. So every output token of the caller's request is the decode
engine's; the prefill's token only decides whether the request goes on. A copy the prefill
engine ends for good (its first token stops it, max_tokens=1, rejected, aborted) ends the
caller's request the same way. The handover is a copy in the process's memory (a device
copy where the engines share a GPU).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from deepinfer.config import EngineRole
from deepinfer.engine import EngineCore
from deepinfer.kv_cache.handover import KVHandover
from deepinfer.kv_cache.hashing import update_block_hashes
from deepinfer.request import FinishReason, Request, RequestStatus
from deepinfer.routing import make_router
from deepinfer.routing.instance_report import report_of, take_report, view_of
from deepinfer.sampling_params import SamplingParams
from deepinfer.stop_checker import check_stop


def parse_disaggregation(spec: str) -> tuple[int, int]:
    """'1P1D' (prefill engines, decode engines: the notation of vLLM's and SGLang's
    disaggregated deployments) -> (1, 1); ValueError naming the argument otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*P\s*(\d+)\s*D\s*", spec, flags=re.IGNORECASE)
    if m is None or not int(m.group(1)) or not int(m.group(2)):
        raise ValueError(
            f"disaggregate={spec!r}: expected '<prefill engines>P<decode engines>D' with "
            "both counts at least 1, e.g. '1P1D'"
        )
    return int(m.group(1)), int(m.group(2))


class _Pool:
    """The engines of one role and their router, which sees them through their reports."""

    def __init__(self, engines: Sequence[EngineCore], router: str, seed: int) -> None:
        self.engines = list(engines)
        self.router = make_router(router, len(self.engines), seed=seed)
        self.views = [view_of(i, e) for i, e in enumerate(self.engines)]

    def place(self, req: Request) -> int:
        return self.router.route(req, self.views)

    def report(self, index: int, finished: Sequence[str]) -> None:
        take_report(self.router, self.views, report_of(index, self.engines[index], finished))


class DisaggregatedEngine:
    def __init__(
        self,
        prefill: Sequence[EngineCore],
        decode: Sequence[EngineCore],
        *,
        router: str = "least-load",
        seed: int = 0,
    ) -> None:
        """prefill, decode: the engines of each role (EngineConfig.role says so; their
        executors export and import KV); router: each pool's policy (deepinfer/routing)."""
        for engines, role in ((prefill, EngineRole.PREFILL), (decode, EngineRole.DECODE)):
            if not engines:
                raise ValueError(f"a disaggregated engine needs at least one {role.value} engine")
            for e in engines:
                if e.config.role is not role:
                    raise ValueError(
                        f"a {role.value} engine of the disaggregated engine has "
                        f"role={e.config.role.value!r}"
                    )
        self.prefill = _Pool(prefill, router, seed)
        self.decode = _Pool(decode, router, seed)
        self.clock = prefill[0].clock
        self.requests: dict[str, Request] = {}  # the callers' live requests
        self._copies: dict[str, Request] = {}  # req_id -> its copy on a prefill engine
        self._placed: dict[str, tuple[_Pool, int]] = {}  # req_id -> where it is now
        self.num_handovers = 0
        self.handover_bytes = 0  # KV handed over, in bytes (the buffers' sizes)

    @property
    def engines(self) -> list[EngineCore]:
        return self.prefill.engines + self.decode.engines

    @property
    def max_model_len(self) -> int:
        return min(e.max_model_len for e in self.engines)

    # ---- requests --------------------------------------------------------------------

    def add_request(self, req: Request) -> str | None:
        """Queue a copy of `req` on the prefill router's engine; returns the rejection
        reason if that engine can never serve it (`req` then ends rejected too)."""
        rid = req.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already live")
        self.check_params(req.sampling_params)
        copy = Request(
            rid, req.prompt, req.sampling_params, req.arrival_time, priority=req.priority,
            eos_token_id=req.eos_token_id, cache_salt=req.cache_salt,
        )  # fmt: skip
        index = self.prefill.place(copy)
        self.requests[rid] = req
        self._copies[rid] = copy
        self._placed[rid] = (self.prefill, index)
        reason = self.prefill.engines[index].add_request(copy)
        if reason is not None:
            self._end_as(req, copy)
            self.prefill.router.on_finished(rid, index)
        return reason

    def check_params(self, sp: SamplingParams) -> None:
        """ValueError naming what a disaggregated engine cannot serve."""
        if sp.prompt_logprobs is not None:
            raise ValueError(
                "SamplingParams.prompt_logprobs: a disaggregated engine computes the prompt "
                "on its prefill engine and hands over its KV, not its logprobs; use one engine"
            )
        if sp.so_args is not None:
            raise ValueError(
                "SamplingParams.so_args: structured outputs are not supported by a "
                "disaggregated engine yet (its grammar would be matched on two engines)"
            )

    def finish(self, req_id: str, reason: FinishReason) -> Request | None:
        """End a live request (abort, or a stop string found in its text) where it is."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        pool, index = self._placed[req_id]
        engine = pool.engines[index]
        engine.finish(req_id, reason)
        if pool is self.prefill:
            self._end_as(req, self._copies[req_id])
        else:  # (the decode engine holds the caller's request itself)
            self._forget(req_id)
        pool.router.on_finished(req_id, index)
        return req

    def abort(self, req_id: str) -> Request | None:
        return self.finish(req_id, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    def discard_in_flight(self) -> None:
        for e in self.engines:
            e.discard_in_flight()

    def drain(self) -> None:
        """Read the steps still in flight once no request is left (async scheduling
        launched them for requests that then ended), so every engine is idle."""
        for e in self.engines:
            while e.has_unfinished() and not e.scheduler.has_unfinished():
                e.step()

    def shutdown(self) -> None:
        """Release every engine's executor."""
        for e in self.engines:
            e.executor.shutdown()

    # ---- the loop --------------------------------------------------------------------

    def step(self) -> list[Request]:
        """One step of every engine with work, prefill engines first (their handovers
        join the decode engines before those step); returns the callers' requests that
        gained tokens or ended."""
        changed: list[Request] = []
        for index, engine in enumerate(self.prefill.engines):
            if not engine.has_unfinished():
                continue
            ended = []
            for copy in engine.step():
                if copy.is_finished and self._copies.get(copy.request_id) is copy:
                    ended.append(copy.request_id)
                    changed += self._after_prefill(copy, engine)
            self.prefill.report(index, ended)
        for index, engine in enumerate(self.decode.engines):
            if not engine.has_unfinished():
                continue
            ended = []
            for req in engine.step():
                changed.append(req)
                if req.is_finished and req.request_id in self.requests:
                    ended.append(req.request_id)
                    self._forget(req.request_id)
            self.decode.report(index, ended)
        return changed

    def _after_prefill(self, copy: Request, engine: EngineCore) -> list[Request]:
        """The prefill engine ended `copy`: hand the request over, or end it as the copy
        ended (its first token stops it, or the prefill engine aborted or rejected it)."""
        rid = copy.request_id
        req = self.requests[rid]
        del self._copies[rid]
        handover = (
            copy.status is RequestStatus.FINISHED
            and copy.finish_reason is FinishReason.LENGTH
            and check_stop(copy, engine.max_model_len) is None
        )
        if not handover:
            self._end_as(req, copy)
            return [req]
        try:
            kv = engine.executor.export_kv(copy, copy.num_prompt_tokens - 1)
        except ValueError as e:
            return [self._abort_unplaced(req, f"KV export: {e}")]
        req.times.first_scheduled = copy.times.first_scheduled
        req.num_cached_tokens = copy.num_cached_tokens  # the prefill engine's prefix hit
        index = self.decode.place(req)
        self._placed[rid] = (self.decode, index)
        target = self.decode.engines[index]
        if target.add_request(req) is not None:  # rejected there (its cache is smaller)
            self._forget(rid)
            self.decode.router.on_finished(rid, index)
            return [req]
        error = _hash_mismatch(kv, req, target.config.block_size)
        if error is None:
            try:
                target.executor.import_kv(kv)
            except ValueError as e:
                error = f"KV import: {e}"
        if error is not None:
            target.finish(rid, FinishReason.ABORT)
            req.reject_reason = error
            self._forget(rid)
            self.decode.router.on_finished(rid, index)
            return [req]
        self.num_handovers += 1
        self.handover_bytes += kv.num_bytes
        return []

    def _end_as(self, req: Request, copy: Request) -> None:
        """End the caller's request as the prefill engine ended its copy (the tokens the
        copy sampled, which then are its whole output)."""
        req.output_token_ids = list(copy.output_token_ids)
        req.logprobs = list(copy.logprobs)
        req.status = copy.status
        req.finish_reason = copy.finish_reason
        req.reject_reason = copy.reject_reason
        req.num_cached_tokens = copy.num_cached_tokens
        t, src = req.times, copy.times
        t.first_scheduled, t.first_token = src.first_scheduled, src.first_token
        t.token_times = list(src.token_times)
        t.finish = src.finish if src.finish is not None else self.clock()
        self._forget(req.request_id)

    def _abort_unplaced(self, req: Request, reason: str) -> Request:
        """End the caller's request, which no engine holds, as aborted with `reason`."""
        req.status = RequestStatus.ABORTED
        req.finish_reason = FinishReason.ABORT
        req.reject_reason = reason
        req.times.finish = self.clock()
        self._forget(req.request_id)
        return req

    def _forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self._copies.pop(req_id, None)
        self._placed.pop(req_id, None)


def _hash_mismatch(kv: KVHandover, req: Request, block_size: int) -> str | None:
    """Why `kv` is not `req`'s prompt on an engine of `block_size` (None: it is)."""
    if kv.block_size != block_size:
        return f"KV import: blocks of {kv.block_size} tokens, the decode engine's hold {block_size}"
    ours = tuple(update_block_hashes(req, block_size)[: len(kv.block_hashes)])
    if ours != kv.block_hashes or kv.num_tokens != req.num_prompt_tokens - 1:
        return "KV import: the KV handed over is not this request's prompt (block hashes differ)"
    return None
