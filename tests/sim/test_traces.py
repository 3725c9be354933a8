"""Trace loading, validation and synthetic prompt content (sim/traces)."""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.request import PromptTokens, Request
from sim.traces import (
    SyntheticPrompt,
    TraceError,
    TraceRequest,
    detect_format,
    load_trace,
    write_native,
)

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "traces"
SHARED = REPO.parent / "shared" / "traces"  # CI clones the repo with shared/ beside it
AZURE_FULL = SHARED / "azure2023_code.csv"
MOONCAKE_FULL = SHARED / "mooncake_fast25_conversation_trace.jsonl"

AZURE_CSV = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:17:03.9799600,4808,10\n"
    "2023-11-16 18:17:04.0319600,3180,8\n"
    "2023-11-16 18:17:03.9000000,110,27"  # earlier than row 1; no trailing newline
)
MOONCAKE_JSONL = (
    '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}\n'
    '{"timestamp": 27482, "input_length": 600, "output_length": 3, "hash_ids": [0, 2]}\n'
)
BURSTGPT_CSV = (
    "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "5,ChatGPT,472,18,490,Conversation log\n"
    "45,ChatGPT,1087,0,1087,Conversation log\n"  # failed request
    "118,GPT-4,417,276,693,API log\n"
)
VIDUR_CSV = "arrived_at,num_prefill_tokens,num_decode_tokens,extra\n0.0,32,8,x\n1.5,16,0,y\n"
NATIVE_JSONL = (
    '{"id": "a", "arrival": 0.5, "prompt_len": 100, "output_len": 4, '
    '"prefix_blocks": [7], "prefix_block_size": 64}\n'
    '{"id": "b", "arrival": 0.25, "prompt_len": 40, "output_len": 2, "priority": 3}\n'
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- bundled files ---------------------------------------------------------


def test_bundled_azure_is_native_json_of_400_requests() -> None:
    trace = load_trace(BUNDLED / "azure_code_small.json")
    assert len(trace) == 400 and trace.name == "azure_code_small"
    assert "CC-BY-4.0" in trace.source
    assert trace.requests[0].arrival == 0.0 and trace.requests[1].arrival == 0.052
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in trace.requests)


def test_bundled_mooncake_keeps_prefix_blocks() -> None:
    trace = load_trace(BUNDLED / "mooncake_conversation_small.jsonl")
    assert len(trace) == 300 and "Apache-2.0" in trace.source
    for r in trace.requests:
        assert r.prefix_block_size == 512
        assert len(r.prefix_blocks) == math.ceil(r.prompt_len / 512)


def test_bundled_example_shares_prefix_blocks() -> None:
    trace = load_trace(BUNDLED / "example.jsonl")
    assert len(trace) == 10 and trace.name == "example"
    uses = Counter(b for r in trace.requests for b in r.prefix_blocks)
    assert uses[1] >= 5
    assert {r.id: r.priority for r in trace.requests}["urgent"] == -1


# --- each format on small files ----------------------------------------------


def test_azure_arrivals_are_exact_and_rebased_to_the_earliest_row(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path, "a.csv", AZURE_CSV))
    assert [r.id for r in trace.requests] == ["r2", "r0", "r1"]
    assert [r.arrival for r in trace.requests] == [0.0, 0.07996, 0.13196]
    assert trace.requests[0].prompt_len == 110 and trace.requests[0].output_len == 27


def test_mooncake_timestamps_are_ms_and_hash_ids_are_512_token_blocks(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path, "m.jsonl", MOONCAKE_JSONL))
    r0, r1 = trace.requests
    assert r1.arrival == 27.482
    assert r0.prefix_blocks == (0, 1) and r1.prefix_blocks == (0, 2)
    assert r0.prefix_block_size == 512 and (r1.prompt_len, r1.output_len) == (600, 3)


def test_burstgpt_skips_failed_requests_and_keeps_row_ids(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        trace = load_trace(write(tmp_path, "b.csv", BURSTGPT_CSV))
    assert [(r.id, r.arrival, r.prompt_len, r.output_len) for r in trace.requests] == [
        ("r0", 5.0, 472, 18),
        ("r2", 118.0, 417, 276),
    ]
    assert "skipped 1 failed" in caplog.text


def test_vidur_replays_zero_decode_as_one_token(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path, "v.csv", VIDUR_CSV))
    assert [(r.arrival, r.prompt_len, r.output_len) for r in trace.requests] == [
        (0.0, 32, 8),
        (1.5, 16, 1),
    ]


def test_azure_zero_output_is_replayed_as_one_token(tmp_path: Path) -> None:
    path = write(
        tmp_path, "z.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00,7,0\n"
    )
    assert load_trace(path).requests[0].output_len == 1


def test_native_jsonl_sorts_by_arrival_and_reads_optional_fields(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path, "n.jsonl", NATIVE_JSONL))
    b, a = trace.requests
    assert (b.id, b.priority, b.prefix_blocks, b.prefix_block_size) == ("b", 3, (), 0)
    assert (a.id, a.prefix_blocks, a.prefix_block_size) == ("a", (7,), 64)
    assert trace.duration == 0.25


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_write_native_round_trips(tmp_path: Path, suffix: str) -> None:
    trace = load_trace(BUNDLED / "example.jsonl")
    out = tmp_path / f"copy{suffix}"
    write_native(trace, out)
    again = load_trace(out)
    assert again.requests == trace.requests
    assert (again.name, again.source) == (trace.name, trace.source)


# --- detection and forced formats --------------------------------------------


@pytest.mark.parametrize(
    ("name", "text", "fmt"),
    [
        ("a.csv", AZURE_CSV, "azure"),
        ("m.jsonl", MOONCAKE_JSONL, "mooncake"),
        ("b.csv", BURSTGPT_CSV, "burstgpt"),
        ("v.csv", VIDUR_CSV, "vidur"),
        ("n.jsonl", NATIVE_JSONL, "native"),
        ("n.json", '{\n "requests": []\n}\n', "native"),
        ("mislabelled.txt", MOONCAKE_JSONL, "mooncake"),  # content decides, not the name
    ],
)
def test_format_is_detected_from_content(tmp_path: Path, name: str, text: str, fmt: str) -> None:
    assert detect_format(write(tmp_path, name, text)) == fmt


def test_undetectable_file_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "odd.csv", "when,size\n1,2\n")
    with pytest.raises(TraceError, match=f"^{path}: cannot detect"):
        load_trace(path)


def test_forced_format_overrides_detection(tmp_path: Path) -> None:
    path = write(tmp_path, "a.csv", AZURE_CSV)
    with pytest.raises(TraceError, match=f"^{path}:1: field 'arrived_at': missing column"):
        load_trace(path, format="vidur")
    assert len(load_trace(path, format="AZURE")) == 3
    with pytest.raises(TraceError, match=f"^{path}: unknown trace format 'sharegpt'"):
        load_trace(path, format="sharegpt")


# --- window, truncation, scaling ----------------------------------------------


def test_window_is_half_open_and_rebased_before_scaling() -> None:
    full = load_trace(BUNDLED / "azure_code_small.json")
    cut = load_trace(BUNDLED / "azure_code_small.json", start=10.0, end=20.0, time_scale=0.5)
    expected = [r for r in full.requests if 10.0 <= r.arrival < 20.0]
    assert [r.id for r in cut.requests] == [r.id for r in expected]
    for got, want in zip(cut.requests, expected, strict=True):
        assert got.arrival == pytest.approx((want.arrival - 10.0) * 0.5)


def test_max_requests_takes_the_earliest(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path, "a.csv", AZURE_CSV), max_requests=2)
    assert [r.id for r in trace.requests] == ["r2", "r0"]


def test_time_scale_multiplies_arrivals() -> None:
    full = load_trace(BUNDLED / "example.jsonl")
    fast = load_trace(BUNDLED / "example.jsonl", time_scale=0.5)
    assert fast.duration == pytest.approx(full.duration / 2)


@pytest.mark.parametrize(
    "kwargs", [{"time_scale": 0.0}, {"max_requests": -1}, {"start": 5, "end": 5}]
)
def test_bad_selection_arguments_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        load_trace(BUNDLED / "example.jsonl", **kwargs)


# --- malformed rows name file, line and field ----------------------------------


def _row(**fields: object) -> str:
    return json.dumps({"arrival": 0, "prompt_len": 4, "output_len": 1, **fields}) + "\n"


_PRETTY = (
    '{"version": 1,\n "requests": [\n  {"arrival": 0, "prompt_len": 5, "output_len": 1},\n'
    '  {"arrival": 1, "prompt_len": 5,\n   "output_len": 0}\n ]}\n'
)
_BLOCKS = {"prefix_block_size": 4}


@pytest.mark.parametrize(
    ("name", "text", "line", "field"),
    [
        ("x.jsonl", _row() + _row(prompt_len="abc"), 2, "prompt_len"),
        ("x.jsonl", "\n" + _row() + '{"prompt_len": 3, "output_len": 1}\n', 3, "arrival"),
        ("x.jsonl", _row(arrival=math.nan), 1, "arrival"),
        ("x.jsonl", _row(output_len=0), 1, "output_len"),
        ("x.jsonl", _row(id="a") + _row(id="a"), 2, "id"),
        ("x.jsonl", _row(prefix_blocks=[1, "x"], **_BLOCKS), 1, "prefix_blocks"),
        ("x.jsonl", _row(prefix_blocks=[1]), 1, "prefix_block_size"),
        ("x.jsonl", _row(prefix_blocks=[1, 2], **_BLOCKS), 1, "prefix_blocks"),  # 8 > 4 tokens
        ("x.json", _PRETTY, 4, "output_len"),
        ("a.csv", AZURE_CSV.replace("2023-11-16 18:17:04", "16/11/2023 18:17:04"), 3, "TIMESTAMP"),
        ("a.csv", AZURE_CSV.replace("3180", "-5"), 3, "ContextTokens"),
        ("a.csv", AZURE_CSV.replace(",110,27", ",110"), 4, "GeneratedTokens"),
        ("m.jsonl", MOONCAKE_JSONL.replace("[0, 2]", '"abc"'), 2, "hash_ids"),
        ("m.jsonl", MOONCAKE_JSONL.replace('"output_length": 3, ', ""), 2, "output_length"),
        ("b.csv", BURSTGPT_CSV.replace(",18,", ",1.5,"), 2, "Response tokens"),
        ("v.csv", VIDUR_CSV.replace("1.5", "inf"), 3, "arrived_at"),
    ],
)
def test_malformed_row_names_file_line_and_field(
    tmp_path: Path, name: str, text: str, line: int, field: str
) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}:{line}: field '{field}': ")
    assert (info.value.path, info.value.line, info.value.field) == (str(path), line, field)


def test_invalid_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "m.jsonl", MOONCAKE_JSONL + '{"timestamp": 1,\n')
    with pytest.raises(TraceError, match=f"^{path}:3: invalid JSON"):
        load_trace(path)


# --- the full public files (in ../shared/traces when present) --------------------


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not present")
    return path


def test_full_azure_code_trace() -> None:
    trace = load_trace(_need(AZURE_FULL))
    assert len(trace) == 8819
    assert trace.duration == pytest.approx(3436, abs=1)
    assert load_trace(BUNDLED / "azure_code_small.json").requests == trace.requests[:400]


def test_full_mooncake_trace_loads_fast_and_shows_real_prefix_reuse() -> None:
    t0 = time.perf_counter()
    trace = load_trace(_need(MOONCAKE_FULL))
    assert time.perf_counter() - t0 < 5.0
    assert len(trace) == 12031
    uses = Counter(b for r in trace.requests for b in set(r.prefix_blocks))
    assert uses.most_common(1)[0][1] == 12031  # every conversation shares block 0
    assert sum(1 for n in uses.values() if n >= 10) > 1000  # and many blocks recur
    assert (
        load_trace(BUNDLED / "mooncake_conversation_small.jsonl").requests == trace.requests[:300]
    )


# --- SyntheticPrompt ---------------------------------------------------------


def _prompt(blocks: tuple[int, ...], prompt_len: int, salt: int, bs: int = 4) -> SyntheticPrompt:
    req = TraceRequest("x", 0.0, prompt_len, 1, prefix_blocks=blocks, prefix_block_size=bs)
    return SyntheticPrompt.for_request(req, salt=salt)


def test_synthetic_prompt_is_prompt_tokens() -> None:
    p = _prompt((1, 2), 12, salt=0)
    assert isinstance(p, PromptTokens) and len(p) == 12
    req = Request("r", p)
    assert req.num_prompt_tokens == 12 and req.token_ids(0, 12) == p.token_ids(0, 12)


def test_equal_prefix_blocks_give_equal_keys_and_ids() -> None:
    a, b = _prompt((7, 8, 9), 20, salt=1), _prompt((5, 7, 8), 12, salt=2)
    assert a.content_key(0, 8) == b.content_key(4, 12)
    assert a.token_ids(0, 8) == b.token_ids(4, 12)
    assert a.content_key(8, 12) != b.content_key(8, 12)  # block 9 vs block 8
    assert a.token_ids(8, 12) != b.token_ids(8, 12)


def test_unique_tails_differ_between_requests() -> None:
    a, b = _prompt((7,), 64, salt=1), _prompt((7,), 64, salt=2)
    assert a.content_key(0, 4) == b.content_key(0, 4)
    assert a.content_key(4, 64) != b.content_key(4, 64)
    assert a.token_ids(4, 64) != b.token_ids(4, 64)


def test_token_ids_are_deterministic_and_in_vocab() -> None:
    req = TraceRequest("x", 0.0, 3000, 1, prefix_blocks=(3, 4), prefix_block_size=512)
    a = SyntheticPrompt.for_request(req, salt=9, vocab_size=1000)
    ids = a.token_ids(0, 3000)
    assert ids == SyntheticPrompt.for_request(req, salt=9, vocab_size=1000).token_ids(0, 3000)
    assert len(ids) == 3000 and all(0 <= t < 1000 for t in ids)
    assert a.token_ids(500, 530) == ids[500:530]
    with pytest.raises(IndexError):
        a.content_key(0, 3001)


@st.composite
def prompt_families(draw: st.DrawFn) -> list[SyntheticPrompt]:
    # A tiny block alphabet and block size make shared and repeated blocks common.
    bs = draw(st.integers(1, 4))
    prompts = []
    for salt in range(draw(st.integers(1, 4))):
        blocks = tuple(draw(st.lists(st.integers(0, 3), max_size=5)))
        lo = (len(blocks) - 1) * bs + 1 if blocks else 1
        prompt_len = draw(st.integers(lo, len(blocks) * bs + 6))
        prompts.append(_prompt(blocks, prompt_len, salt=salt, bs=bs))
    return prompts


@settings(max_examples=300, deadline=None)
@given(prompt_families(), st.data())
def test_content_key_equality_matches_token_id_equality(
    prompts: list[SyntheticPrompt], data: st.DataObject
) -> None:
    """Equal keys mean equal ids (always); equal ids mean equal keys (spans of 4+ tokens,
    where an accidental match of pseudo-random ids has odds below 1e-18)."""
    a, b = data.draw(st.sampled_from(prompts)), data.draw(st.sampled_from(prompts))
    n = data.draw(st.integers(0, min(len(a), len(b))))
    sa = data.draw(st.integers(0, len(a) - n))
    sb = data.draw(st.integers(0, len(b) - n))
    same_key = a.content_key(sa, sa + n) == b.content_key(sb, sb + n)
    same_ids = a.token_ids(sa, sa + n) == b.token_ids(sb, sb + n)
    if same_key:
        assert same_ids
    if n >= 4:
        assert same_key == same_ids


@settings(max_examples=300, deadline=None)
@given(prompt_families(), st.integers(1, 6), st.data())
def test_block_keys_are_each_spans_content_key(
    prompts: list[SyntheticPrompt], size: int, data: st.DataObject
) -> None:
    """The keys of a run of blocks in one call are content_key's, span by span: in the
    prefix blocks (inside one, or across two), across their end and in the unique tail."""
    p = data.draw(st.sampled_from(prompts))
    stop = data.draw(st.integers(0, len(p) // size))
    first = data.draw(st.integers(0, stop))
    spans = range(first * size, stop * size, size)
    assert p.block_keys(first, stop, size) == [p.content_key(s, s + size) for s in spans]
    with pytest.raises(IndexError):
        p.block_keys(0, len(p) // size + 1, size)
