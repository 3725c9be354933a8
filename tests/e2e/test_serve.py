"""`deepinfer serve` as a client sees it: real server processes on free local ports (the
demo model on the CPU, and its simulated twin), spoken to by the official openai client
and by raw HTTP. Each server starts once for the module; the last test drains the real
one with SIGTERM."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key"
MODEL = "deepinfer-demo"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}{% if m['name'] %} {{ m['name'] }}{% endif %}: "
    "{{ m['content'] }}\n{% endfor %}"
) + ("{% if add_generation_prompt %}assistant:{% endif %}")


class Server:
    def __init__(self, args: list[str], log: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log
        cmd = [sys.executable, "-m", "deepinfer", "serve", *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*cmd, "--log-level", "warning"],
            cwd=ROOT,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, key: str | None = None, timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                break
            try:
                if self.get("/health", key)[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"server did not start:\n{self.log.read_text()}")

    def request(
        self, method: str, path: str, body: bytes | None = None, key: str | None = None
    ) -> tuple[int, dict[str, str], str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        return resp.status, dict(resp.getheaders()), text

    def get(self, path: str, key: str | None = KEY) -> tuple[int, str]:
        status, _, text = self.request("GET", path, key=key)
        return status, text

    def post(self, path: str, body: Any, key: str | None = KEY) -> tuple[int, dict[str, Any]]:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, _, text = self.request("POST", path, raw, key)
        return status, json.loads(text)

    def metric(self, name: str, key: str | None = KEY, **labels: str) -> float:
        text = self.get("/metrics", key)[1]
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} {labels} not in /metrics")

    def client(self, key: str | None = KEY) -> Any:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    tmp = tmp_path_factory.mktemp("serve")
    template = tmp / "chat.jinja"
    template.write_text(TEMPLATE)
    real = Server(
        # One sequence at a time: the CPU's numerics depend on the batch (normal mode is not
        # batch invariant), so tokens compared with LLM.generate's need the same batches.
        [MODEL, "--api-key", KEY, "--chat-template", str(template), "--max-num-seqs", "1"],
        tmp / "real.log",
    )
    twin = Server(
        [MODEL, "--executor", "sim", "--hardware", "cpu", "--max-num-seqs", "2",
         "--max-waiting", "2", "--drain-timeout", "1"],
        tmp / "twin.log",
    )  # fmt: skip
    try:
        real.wait_ready(KEY)
        twin.wait_ready()
        yield real, twin
    finally:
        real.stop()
        twin.stop()


@pytest.fixture(scope="module")
def real(servers: tuple[Server, Server]) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def twin(servers: tuple[Server, Server]) -> Server:
    return servers[1]


def test_32_concurrent_streams_finish_with_llm_generates_greedy_tokens(real: Server) -> None:
    """Streams and whole responses both carry what the offline API generates: 32 streams
    at once queue at the server, which (as the offline engine here) runs one sequence at a
    time, so both compute every token in the same batch shape."""
    from deepinfer import LLM, SamplingParams

    prompts = [f"def function_{i}(x):" for i in range(32)]
    llm = LLM(MODEL, max_num_seqs=1)
    expected = [
        o.outputs[0].text
        for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
        )
    ]
    llm.shutdown()

    async def stream(client: Any, prompt: str) -> tuple[str, str | None]:
        parts, reason = [], None
        chunks = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0, stream=True
        )
        async for chunk in chunks:
            parts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        return "".join(parts), reason

    async def all_streams() -> list[tuple[str, str | None]]:
        client = openai.AsyncOpenAI(base_url=real.url + "/v1", api_key=KEY, max_retries=0)
        try:
            return await asyncio.gather(*(stream(client, p) for p in prompts))
        finally:
            await client.close()

    got = asyncio.run(all_streams())
    assert [t for t, _ in got] == expected
    assert {r for _, r in got} <= {"length", "stop"}
    whole = real.client().completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0.0
    )
    assert whole.choices[0].text == expected[0]
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 0


def test_chat_streams_what_it_answers_whole(real: Server) -> None:
    client = real.client()
    messages = [{"role": "user", "content": "Write a loop."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0.0
    )
    assert whole.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=10, temperature=0.0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n2_seeds_reproduce_and_stop_strings_end_the_text(real: Server) -> None:
    client = real.client()

    def sample() -> list[str]:
        out = client.completions.create(
            model=MODEL, prompt="import os\n", max_tokens=24, temperature=1.0, n=2, seed=7
        )
        assert [c.index for c in out.choices] == [0, 1]
        return [c.text for c in out.choices]

    first = sample()
    assert sample() == first
    stopped = client.completions.create(
        model=MODEL, prompt="def main():\n", max_tokens=64, temperature=0.0, stop=["\n"]
    )
    assert "\n" not in stopped.choices[0].text
    assert stopped.choices[0].finish_reason == "stop"


def test_json_schema_outputs_validate_and_logprobs_come_per_token(real: Server) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0}},
        "required": ["age"],
    }
    out = real.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Age?"}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    lp = real.client().completions.create(model=MODEL, prompt="x = ", max_tokens=5, logprobs=2)
    assert len(lp.choices[0].logprobs.token_logprobs) == lp.usage.completion_tokens


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b'{"prompt": "x", ', "body", "malformed JSON"),
        ({"prompt": "x", "max_tokns": 3}, "max_tokns", "unknown field"),
        ({"prompt": [5] * 3000, "max_tokens": 2}, "prompt", "3000 tokens"),
        ({"prompt": [10**7], "stop": ["x"]}, "prompt", "outside the model's vocabulary"),
        ({"prompt": "x", "temperature": -1}, "temperature", "must be >= 0"),
        ({"prompt": "x", "logit_bias": {"1": 1}}, "logit_bias", "not supported"),
        (
            {"prompt": "x", "response_format": {"type": "json_schema",
             "json_schema": {"name": "s", "schema": {"type": "foo"}}}},
            "response_format",
            "invalid JSON Schema",
        ),
        (
            {"prompt": "x", "response_format": {"type": "json_schema",
             "json_schema": {"name": "s", "schema": {"type": "object"}, "strict": False}}},
            "response_format",
            "strict: false is not supported",
        ),
    ],
)  # fmt: skip
def test_bad_requests_are_one_400_naming_the_field_and_the_server_goes_on(
    real: Server, body: Any, param: str, words: str
) -> None:
    status, reply = real.post("/v1/completions", body)
    assert status == 400
    assert reply["error"]["param"] == param and words in reply["error"]["message"]
    assert "\n" not in reply["error"]["message"]
    status, reply = real.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200 and reply["choices"][0]["finish_reason"]


def test_a_chat_messages_name_reaches_the_template(real: Server) -> None:
    """`name` (a participant's) is passed to the chat template with the message, as
    transformers passes every key; a template that prints it makes a longer prompt."""
    client = real.client()
    plain = [{"role": "user", "content": "hello"}]
    named = [{"role": "user", "content": "hello", "name": "ada lovelace"}]
    a = client.chat.completions.create(model=MODEL, messages=plain, max_tokens=1)
    b = client.chat.completions.create(model=MODEL, messages=named, max_tokens=1)
    assert b.usage.prompt_tokens > a.usage.prompt_tokens


def test_every_route_needs_the_api_key(real: Server) -> None:
    assert real.get("/health", key=None)[0] == 401
    assert real.get("/metrics", key="wrong")[0] == 401
    status, reply = real.post("/v1/completions", {"prompt": "x"}, key=None)
    assert status == 401 and reply["error"]["type"] == "authentication_error"
    assert real.client().models.list().data[0].id == MODEL


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(real: Server) -> None:
    aborted = real.metric("deepinfer_requests_total", state="aborted")
    conn = http.client.HTTPConnection("127.0.0.1", real.port, timeout=30)
    body = {"prompt": "def f():", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    conn.request(
        "POST", "/v1/completions", json.dumps(body),
        {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )  # fmt: skip
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    assert real.metric("deepinfer_kv_cache_usage_perc") > 0
    conn.sock.close()  # type: ignore[union-attr]  # leave without reading the rest
    conn.close()
    end = time.monotonic() + 20
    while real.metric("deepinfer_requests_total", state="aborted") == aborted:
        assert time.monotonic() < end, "the request was not aborted"
        time.sleep(0.1)
    assert real.metric("deepinfer_kv_cache_usage_perc") == 0.0
    assert real.metric("deepinfer_num_requests_running") == 0
    assert real.metric("deepinfer_time_to_first_token_seconds_count") > 0


def test_the_sim_twin_answers_the_openai_client(twin: Server) -> None:
    client = twin.client()
    out = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=8, seed=1)
    assert out.usage.completion_tokens == 8 and out.choices[0].text
    again = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=8, seed=1)
    assert again.choices[0].text == out.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=5,
                                            stream=True))  # fmt: skip
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, logprobs=1)


def test_the_sim_twin_refuses_structured_outputs_by_name(twin: Server) -> None:
    """Its tokens are random and it compiles no grammar: a constraint would be ignored."""
    for field, value in [
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"schema": {}}}),
        ("structured_outputs", {"regex": "a+"}),
        ("guided_grammar", "root ::= 'a'"),
    ]:
        status, reply = twin.post("/v1/completions", {"prompt": "x", field: value})
        assert status == 400 and reply["error"]["param"] == field, reply
        assert "grammar" in reply["error"]["message"]
    status, _ = twin.post("/v1/completions", {"prompt": "x", "response_format": {"type": "text"}})
    assert status == 200


def test_more_completions_than_max_waiting_is_a_400_naming_n(twin: Server) -> None:
    """n=3 against --max-waiting 2 could never be admitted, idle server or not."""
    status, reply = twin.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 3})
    assert status == 400 and reply["error"]["param"] == "n"
    assert "--max-waiting" in reply["error"]["message"]
    status, reply = twin.post("/v1/completions", {"prompt": ["x"] * 3, "max_tokens": 2})
    assert status == 400 and reply["error"]["param"] == "prompt"


def test_max_waiting_must_let_a_request_wait(capsys: pytest.CaptureFixture[str]) -> None:
    from deepinfer.entrypoints.cli import main

    assert main(["serve", "--max-waiting", "0"]) != 0
    assert "--max-waiting 0: must be >= 1" in capsys.readouterr().err


def test_max_waiting_answers_503_under_a_burst_and_loses_no_request(twin: Server) -> None:
    """A burst, some requests sent a little apart (so some arrive while earlier ones are
    being admitted): the waiting gauge never passes --max-waiting 2."""

    async def one(client: Any, i: int) -> int | str:
        await asyncio.sleep(0.002 * (i % 8))
        try:
            out = await client.completions.create(model=MODEL, prompt="x", max_tokens=20)
        except openai.APIStatusError as e:
            assert e.response.headers["retry-after"] == "1"
            return e.status_code
        return out.usage.completion_tokens

    peak = [0.0]

    async def watch(done: asyncio.Event) -> None:
        while not done.is_set():
            gauge = await asyncio.to_thread(twin.metric, "deepinfer_num_requests_waiting")
            peak[0] = max(peak[0], gauge)

    async def burst() -> list[int | str]:
        client = openai.AsyncOpenAI(base_url=twin.url + "/v1", api_key="none", max_retries=0)
        done = asyncio.Event()
        watcher = asyncio.ensure_future(watch(done))
        try:
            return await asyncio.gather(*(one(client, i) for i in range(24)))
        finally:
            done.set()
            await watcher
            await client.close()

    got = asyncio.run(burst())
    assert got.count(503) > 0
    assert peak[0] <= 2
    assert all(g == 20 for g in got if g != 503)  # every admitted request completed whole
    assert twin.metric("deepinfer_requests_overloaded_total") == got.count(503)
    assert twin.metric("deepinfer_requests_total", state="finished") >= len(got) - got.count(503)


def _tiny_trace(tmp_path: Path) -> Path:
    """Six Mooncake requests that share their first block."""
    trace = tmp_path / "tiny.jsonl"
    rows = [
        {"timestamp": 40 * i, "input_length": 200 + 30 * i, "output_length": 4 + i,
         "hash_ids": [7]}
        for i in range(6)
    ]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return trace


def test_bench_serve_refuses_simulator_options_without_compare_sim(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from deepinfer.entrypoints.cli import main

    args = ["bench", "serve", str(_tiny_trace(tmp_path)), "--base-url", "http://127.0.0.1:1"]
    assert main([*args, "--hardware", "cpu", "--max-num-seqs", "2", "--seed", "3"]) != 0
    assert "--hardware, --max-num-seqs: options of the simulation" in capsys.readouterr().err


def test_bench_serve_fails_when_every_request_failed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from deepinfer.entrypoints.cli import main

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["bench", "serve", str(_tiny_trace(tmp_path)), "--base-url", f"http://127.0.0.1:{port}",
            "--model", MODEL, "--vocab-size", "100", "--no-progress", "--request-rate", "inf"]  # fmt: skip
    assert main(args) == 1
    assert "every request failed" in capsys.readouterr().err


@pytest.mark.parametrize("which", ["real", "twin"])
def test_bench_serve_replays_a_trace_against_the_server(
    which: str, servers: tuple[Server, Server], tmp_path: Path
) -> None:
    """A Mooncake trace whose requests share their first block: replayed at its own
    arrival times (halved) against the model, as a Poisson process against the twin with
    the simulator's prediction beside (at 5 requests a second: the twin lets only two
    wait, so a faster burst on a loaded machine is answered 503, which
    test_max_waiting_answers_503_under_a_burst_and_loses_no_request covers)."""
    server = servers[0] if which == "real" else servers[1]
    trace = _tiny_trace(tmp_path)
    hits = server.metric("deepinfer_prefix_cache_hits_total") if which == "real" else 0
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "deepinfer", "bench", "serve", str(trace), "--base-url",
        server.url, "--no-progress", "--out", str(out), "--slo", "ttft:60000",
    ]  # fmt: skip
    if which == "real":
        cmd += ["--api-key", KEY, "--time-scale", "0.5"]
    else:
        cmd += ["--request-rate", "5", "--compare-sim", "--hardware", "cpu", "--max-num-seqs", "2"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Mean TTFT (ms)" in run.stdout and "P99 ITL (ms)" in run.stdout
    report = json.loads(out.read_text())
    assert [r["status"] for r in report["requests"]] == ["finished"] * 6
    assert [r["num_output_tokens"] for r in report["requests"]] == [4 + i for i in range(6)]
    assert report["summary"]["num_good"] == 6
    if which == "real":  # the shared block is one prefix in the server's cache
        assert server.metric("deepinfer_prefix_cache_hits_total") > hits
    else:
        assert re.search(r"TTFT median \(ms\)\s+[\d.]+\s+[\d.]+\s+[+-][\d.]+%", run.stdout)


def test_sigterm_drains_the_running_stream_then_exits(real: Server) -> None:
    """Last: it stops the module's real server."""
    got: dict[str, Any] = {}

    def stream() -> None:
        chunks = real.client().completions.create(
            model=MODEL, prompt="class A:", max_tokens=80, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for c in chunks:
            got.setdefault("first", True)
            if c.choices and c.choices[0].finish_reason:
                got["reason"] = c.choices[0].finish_reason
            if c.usage is not None:
                got["tokens"] = c.usage.completion_tokens

    thread = threading.Thread(target=stream)
    thread.start()
    end = time.monotonic() + 20
    while "first" not in got and time.monotonic() < end:
        time.sleep(0.01)
    real.proc.send_signal(signal.SIGTERM)
    thread.join(30)
    assert got.get("reason") == "length" and got.get("tokens") == 80
    assert real.proc.wait(30) == 0


def test_sigterm_past_the_drain_timeout_ends_streams_with_abort_and_done(twin: Server) -> None:
    """Last for the twin (--drain-timeout 1): a stream that outlives the drain is aborted
    by the engine, so it ends with finish_reason "abort" and [DONE], not cut."""
    longest = twin.client().models.list().data[0].model_extra["max_model_len"]
    conn = http.client.HTTPConnection("127.0.0.1", twin.port, timeout=30)
    body = {"prompt": [1, 2, 3], "max_tokens": longest - 3, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    twin.proc.send_signal(signal.SIGTERM)
    events = [line for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    conn.close()
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert twin.proc.wait(30) == 0


# ---- in process: the engine thread and the app, over a twin with a unit cost model ------


def _twin(model: str = MODEL, **config: Any) -> Any:
    from deepinfer.config import EngineConfig
    from deepinfer.entrypoints.openai.async_engine import AsyncEngine
    from deepinfer.entrypoints.openai.served_model import simulated_model
    from deepinfer.entrypoints.openai.server_metrics import ServerMetrics

    served = simulated_model(model, EngineConfig(**config), hardware="cpu", cost_model="unit")
    return AsyncEngine(served, ServerMetrics(served.name))


def _handle(engine: Any, max_tokens: int, n: int = 1) -> Any:
    from deepinfer.entrypoints.openai.async_engine import RequestHandle
    from deepinfer.sampling_params import SamplingParams

    rid = engine.next_id()
    sp = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
    prompt = engine.served.processor.track(rid, None, [1, 2, 3], sp, 0.0)
    return RequestHandle(rid, [prompt])


def test_an_admitted_request_counts_as_waiting_before_the_next_step() -> None:
    """--max-waiting's count: the moment a request is admitted, it is in the scheduler's
    waiting count the event loop sees (the step that takes it has not run yet)."""
    engine = _twin(max_num_seqs=1)
    step, gate = engine.served.step, threading.Event()

    def held_step() -> Any:
        gate.wait(10)
        return step()

    engine.served.step = held_step

    async def admit() -> int:
        engine.start(asyncio.get_running_loop())
        handle = _handle(engine, max_tokens=2)
        engine.submit(handle)
        assert await handle.admitted() is None
        waiting = engine.num_waiting
        gate.set()
        async for _ in handle.deltas():
            pass
        return waiting

    try:
        assert asyncio.run(admit()) == 1
    finally:
        gate.set()
        engine.shutdown()


def _app_client(engine: Any) -> Any:
    from starlette.testclient import TestClient

    from deepinfer.entrypoints.openai.app import build_app

    return TestClient(build_app(engine), raise_server_exceptions=False)


def test_a_completion_that_fails_ends_its_siblings() -> None:
    """n=2, whole response: completion 0 ends in error (a 500); completion 1 is aborted
    at once rather than run to its max_tokens."""
    engine = _twin()
    core, step = engine.served.engine, engine.served.step

    def failing_step() -> Any:
        changed = step()
        if "0.0#0" in core.scheduler.requests and len(changed) > 0:
            failed = core.abort("0.0#0")
            failed.reject_reason = "its grammar failed"
            changed.append(failed)
        return changed

    engine.served.step = failing_step
    with _app_client(engine) as client:
        longest = engine.served.max_model_len
        reply = client.post(
            "/v1/completions",
            json={"prompt": [1, 2, 3], "n": 2, "max_tokens": longest - 3, "ignore_eos": True},
        )
        assert reply.status_code == 500 and "its grammar failed" in reply.text
        end = time.monotonic() + 5
        while engine.metrics.requests["aborted"] < 2:
            assert time.monotonic() < end, "the sibling completion still runs"
            time.sleep(0.01)
        assert engine.metrics.requests["finished"] == 0


def test_a_dead_engine_thread_fails_its_requests_and_health_says_so() -> None:
    """A bug outside a step (here: the step hands back something that is no request)
    ends the engine thread: the live request fails at once, /health answers 503, and a
    later request is a 503 rather than a hang."""
    engine = _twin()
    step = engine.served.step
    engine.served.step = lambda: [*step(), None]
    with _app_client(engine) as client:
        assert client.get("/health").status_code == 200
        reply = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 50})
        assert reply.status_code == 500 and "AttributeError" in reply.text
        health = client.get("/health")
        assert health.status_code == 503 and "engine loop died" in health.text
        reply = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 5})
        assert reply.status_code == 503 and "engine loop died" in reply.text


def test_a_stop_string_without_a_tokenizer_is_a_400_naming_stop() -> None:
    """A preset's twin has no tokenizer: a stop string is refused as `stop`."""
    with _app_client(_twin("deepseek-v2-lite", max_model_len=512)) as client:
        reply = client.post("/v1/completions", json={"prompt": [1, 2, 3], "stop": ["x"]})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "stop"
        assert error["message"].startswith("stop=['x']: stop strings")


def test_a_model_without_a_tokenizer_streams_a_chunk_per_delta_of_tokens() -> None:
    """A preset's random weights have no tokenizer, so no text: each delta of tokens is
    still a chunk (empty text), which `bench serve` times as a token."""
    from deepinfer.entrypoints.openai.async_engine import Delta
    from deepinfer.entrypoints.openai.responses import ResponseShape

    bare = ResponseShape(False, "r", MODEL, 1, None, False)
    assert bare.chunk(Delta(0, 0, "", [5], None))["choices"][0]["text"] == ""
    assert bare.chunk(Delta(0, 0, "", [], None)) is None  # nothing new
    with_text = ResponseShape(False, "r", MODEL, 1, object(), False)
    assert with_text.chunk(Delta(0, 0, "", [5], None)) is None  # a character not complete


def test_a_served_name_is_escaped_in_metrics_labels() -> None:
    """A quote, backslash or newline in a served name (the user's) would break every line
    of /metrics that carries it: Prometheus' text format escapes them."""
    from deepinfer.entrypoints.openai.server_metrics import ServerMetrics

    assert ServerMetrics('my "m"\\1\n')._labels == 'model_name="my \\"m\\"\\\\1\\n",'
