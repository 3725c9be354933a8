"""The HTTP application: OpenAI's /v1/completions, /v1/chat/completions and /v1/models,
plus /health and /metrics (Prometheus), over one `AsyncEngine`.

A body is parsed by hand (`protocol.py`), so malformed JSON, an unknown field or a
refused value is a 400 whose message names the field. A request the engine rejects (a
prompt that can never fit) is a 400 with the engine's reason, which names the sizes.
When more than `max_waiting` engine requests would wait, the answer is 503 with
Retry-After, and the request is never queued (one that alone asks for more completions
than that is a 400: it could never be admitted). While the server drains (SIGTERM) or
after the engine thread died, a request is a 503, and /health answers 503 once it died. A client that disconnects has its
completions aborted, which frees their KV blocks: a stream's generator is cancelled
(Starlette watches the connection), a whole response races the engine against
`http.disconnect`. `api_key` guards every route (`Authorization: Bearer KEY`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from deepinfer.entrypoints.openai.async_engine import AsyncEngine, RequestHandle
from deepinfer.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    field_error,
    validation_error,
)
from deepinfer.entrypoints.openai.responses import Choice, ResponseShape, gather
from deepinfer.sampling_params import SamplingParams

Body = TypeVar("Body", bound=BaseModel)
RETRY_AFTER_S = 1  # what a 503 tells the client to wait


def build_app(
    engine: AsyncEngine, *, api_key: str | None = None, max_waiting: int | None = None
) -> FastAPI:
    served = engine.served

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        yield
        engine.shutdown()

    app = FastAPI(title="deepinfer", lifespan=lifespan)
    if api_key:
        app.add_middleware(_RequireKey, key=api_key)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.get("/health")
    async def health() -> Response:
        if engine.error is not None:
            error = OpenAIError(f"the engine loop died: {engine.error}", status=503,
                                kind="server_error")  # fmt: skip
            return JSONResponse(error.body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": served.name,
            "object": "model",
            "created": 0,
            "owned_by": "deepinfer",
            "max_model_len": served.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        sp = body.sampling_params()
        prompts: list[tuple[str | None, list[int]]] = []
        for p in body.prompts():
            try:
                prompts.append(served.processor.tokenize(p))
            except ValueError as e:
                raise OpenAIError(f"prompt: {e}", "prompt") from None
        return await _generate(request, body, sp, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        sp = body.sampling_params()
        template, tokenizer = served.chat_template, served.processor.tokenizer
        if template is None or tokenizer is None:
            raise OpenAIError(
                f"{served.name} has no chat template (its tokenizer_config.json names none); "
                "start the server with --chat-template, or use /v1/completions",
                "messages",
            )
        # The participant's name, where given, reaches the template (as transformers
        # passes every key of a message).
        messages = [
            {"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {})
            for m in body.messages
        ]
        try:
            text = template.render(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            )
        except ValueError as e:
            raise OpenAIError(str(e), "messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        return await _generate(request, body, sp, [(text, ids)], chat=True)

    async def _generate(
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        sp: SamplingParams,
        prompts: list[tuple[str | None, list[int]]],
        chat: bool,
    ) -> Response:
        _check(body, sp, prompts, chat)
        wanted = len(prompts) * sp.n
        if max_waiting is not None and wanted > max_waiting:
            param = "n" if sp.n > 1 else "prompt"
            raise OpenAIError(
                f"{param}: {len(prompts)} prompt(s) x n={sp.n} are {wanted} completions, "
                f"more than the {max_waiting} that may wait (--max-waiting): never admitted",
                param,
            )
        if engine.draining or engine.error is not None:
            why = f"the engine loop died: {engine.error}" if engine.error else "shutting down"
            raise OpenAIError(f"the server is down: {why}", status=503, kind="server_error")
        if max_waiting is not None and engine.num_waiting + wanted > max_waiting:
            engine.metrics.count_overloaded()
            raise OpenAIError(
                f"the server is busy: {engine.num_waiting} requests wait and at most "
                f"{max_waiting} may (--max-waiting); retry after {RETRY_AFTER_S} s",
                status=503,
                kind="server_overloaded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        rid = engine.next_id()
        now = served.engine.clock()
        tracked = [
            served.processor.track(f"{rid}.{i}", text, ids, sp, now, body.priority)
            for i, (text, ids) in enumerate(prompts)
        ]
        handle = RequestHandle(rid, tracked)
        try:
            engine.submit(handle)
            reason = await handle.admitted()
        except asyncio.CancelledError:
            engine.abort(handle)
            raise
        except RuntimeError as e:  # the engine loop died
            raise OpenAIError(str(e), status=503, kind="server_error") from None
        if reason is not None:
            raise OpenAIError(reason, "messages" if chat else "prompt")
        shape = ResponseShape(
            chat, rid, served.name, sp.n, served.processor.tokenizer, sp.logprobs is not None
        )
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                _stream(engine, handle, shape, usage), media_type="text/event-stream"
            )
        whole = _whole(engine, handle, shape)
        return await _until_disconnect(request, whole, lambda: engine.abort(handle))

    def _check(
        body: CompletionRequest | ChatCompletionRequest,
        sp: SamplingParams,
        prompts: list[tuple[str | None, list[int]]],
        chat: bool,
    ) -> None:
        if body.model is not None and body.model != served.name:
            raise OpenAIError(
                f"model {body.model!r} is not served here (this server serves {served.name!r})",
                "model",
                status=404,
                kind="model_not_found",
            )
        if served.simulated and sp.logprobs is not None:
            raise OpenAIError(
                "logprobs: the simulated server draws its tokens at random; it has no "
                "distribution to report",
                "top_logprobs" if chat else "logprobs",
            )
        structured = body.structured_field()
        if served.simulated and structured is not None:
            raise OpenAIError(
                f"{structured}: the simulated server draws its tokens at random and "
                "compiles no grammar; it cannot constrain them",
                structured,
            )
        if body.priority and served.engine.config.policy != "priority":
            raise OpenAIError(
                f"priority: the engine schedules {served.engine.config.policy!r}; start it "
                "with --policy priority",
                "priority",
            )
        try:
            served.processor.check_params(sp)
        except ValueError as e:
            raise field_error(e) from None
        for i, (_, ids) in enumerate(prompts):
            try:
                served.processor.check_prompt(i, ids)
            except ValueError as e:
                raise OpenAIError(str(e), "messages" if chat else "prompt") from None

    return app


async def _parse(request: Request, model: type[Body]) -> Body:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"body: malformed JSON: {e}", "body") from None
    if not isinstance(data, dict):
        raise OpenAIError("body: expected a JSON object", "body")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def _usage(handle: RequestHandle, completion_tokens: int) -> dict[str, int]:
    prompt = sum(handle.num_prompt_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


async def _whole(engine: AsyncEngine, handle: RequestHandle, shape: ResponseShape) -> JSONResponse:
    """The whole response; a completion that ends in error ends its siblings too."""
    choices: dict[int, Choice] = {}
    try:
        async for deltas in handle.deltas():
            for d in deltas:
                if d.error is not None:
                    raise OpenAIError(d.error, status=500, kind="server_error")
            gather(choices, shape, deltas)
    except RuntimeError as e:
        raise OpenAIError(str(e), status=500, kind="server_error") from None
    finally:
        engine.abort(handle)  # (nothing to do once every completion has finished)
    usage = _usage(handle, sum(c.num_tokens for c in choices.values()))
    return JSONResponse(shape.response(choices, usage))


async def _stream(
    engine: AsyncEngine, handle: RequestHandle, shape: ResponseShape, include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per delta, the usage chunk if asked, `[DONE]`. A
    client that leaves cancels this generator: its completions are aborted."""
    tokens = 0
    try:
        async for deltas in handle.deltas():
            for d in deltas:
                tokens += len(d.token_ids)
                if d.error is not None:
                    yield _event(OpenAIError(d.error, kind="server_error").body())
                    continue
                chunk = shape.chunk(d)
                if chunk is not None:
                    yield _event(chunk)
        if include_usage:
            yield _event(shape.usage_chunk(_usage(handle, tokens)))
    except RuntimeError as e:
        yield _event(OpenAIError(str(e), kind="server_error").body())
    finally:
        engine.abort(handle)  # (nothing to do once every completion has finished)
    yield "data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _until_disconnect(
    request: Request, work: Awaitable[Response], on_disconnect: Callable[[], None]
) -> Response:
    """`work`'s response, unless the client disconnects first: then `on_disconnect()`."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    on_disconnect()
    return Response(status_code=499)  # (nobody reads it: nginx's "client closed request")


class _RequireKey:
    """ASGI middleware: every HTTP route needs `Authorization: Bearer <key>` (401 else)."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                error = OpenAIError(
                    "missing or wrong API key (Authorization: Bearer KEY)",
                    status=401,
                    kind="authentication_error",
                )
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
