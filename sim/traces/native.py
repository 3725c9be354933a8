"""The native trace format (traces/README.md documents it): read, validate, write.

`.json`: one object ``{"version": 1, "name", "source", "requests": [...]}``.
`.jsonl`: one request object a line, optionally preceded by a header line
``{"version": 1, "name": ..., "source": ...}`` (a line without "prompt_len").
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from sim.traces.fields import (
    FieldError,
    check_blocks_fit,
    parse_block_ids,
    parse_int,
    parse_seconds,
)
from sim.traces.model import Trace, TraceError, TraceRequest

VERSION = 1
_POSITIVE = "a positive integer"


def parse_request(obj: object, index: int) -> TraceRequest:
    """One native request object; `index` (0-based, file order) names it when "id" is absent."""
    if not isinstance(obj, dict):
        raise FieldError("request", f"expected a JSON object, got {obj!r}")
    rid = obj.get("id", f"r{index}")
    if type(rid) is int:
        rid = str(rid)
    if not isinstance(rid, str) or not rid:
        raise FieldError("id", f"expected a non-empty string, got {rid!r}")
    for key in ("arrival", "prompt_len", "output_len"):
        if key not in obj:
            raise FieldError(key, "missing")
    prompt_len = parse_int("prompt_len", obj["prompt_len"], minimum=1, what=_POSITIVE)
    blocks = parse_block_ids("prefix_blocks", obj.get("prefix_blocks", []))
    block_size = 0
    if blocks:  # without blocks a block size means nothing and is ignored
        if "prefix_block_size" not in obj:
            raise FieldError("prefix_block_size", "missing (required with prefix_blocks)")
        block_size = parse_int(
            "prefix_block_size", obj["prefix_block_size"], minimum=1, what=_POSITIVE
        )
        check_blocks_fit("prefix_blocks", len(blocks), block_size, prompt_len)
    return TraceRequest(
        id=rid,
        arrival=parse_seconds("arrival", obj["arrival"]),
        prompt_len=prompt_len,
        output_len=parse_int("output_len", obj["output_len"], minimum=1, what=_POSITIVE),
        prefix_blocks=blocks,
        prefix_block_size=block_size,
        priority=parse_int("priority", obj.get("priority", 0), minimum=None, what="an integer"),
        structured=_parse_bool("structured", obj.get("structured", False))
        or _has_so_args(obj.get("so_args")),
    )


def _has_so_args(value: object) -> bool:
    """A request's `so_args`, as SamplingParams takes it: the simulator samples no tokens,
    so only its presence matters (the request is structured); its shape is checked."""
    from deepinfer.structured_outputs import SCHEMA_TYPES

    if value is None:
        return False
    if not isinstance(value, dict) or value.get("schema_type") not in SCHEMA_TYPES:
        raise FieldError(
            "so_args", f'expected {{"schema_type": one of {SCHEMA_TYPES}, "schema": ...}}'
        )
    return True


def _parse_bool(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise FieldError(field, f"expected true or false, got {value!r}")
    return value


def load_native(path: Path) -> Trace:
    text = path.read_text(encoding="utf-8-sig")
    first = text.lstrip().partition("\n")[0]
    try:
        head = json.loads(first)
    except json.JSONDecodeError:
        head = None  # a multi-line JSON document
    if isinstance(head, dict) and "requests" not in head:
        return _load_jsonl(path, text)
    return _load_json(path, text)


def _header(path: Path, obj: dict[str, Any], line: int) -> tuple[str, str]:
    version = obj.get("version", VERSION)
    if version != VERSION:
        raise TraceError(
            path, f"unsupported version {version!r}, expected {VERSION}", line=line, field="version"
        )
    name, source = obj.get("name", path.stem), obj.get("source", str(path))
    for key, value in (("name", name), ("source", source)):
        if not isinstance(value, str):
            raise TraceError(path, f"expected a string, got {value!r}", line=line, field=key)
    return name, source


def _load_jsonl(path: Path, text: str) -> Trace:
    name, source = path.stem, str(path)
    requests: list[TraceRequest] = []
    seen: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(path, f"invalid JSON: {e.msg}", line=lineno) from None
        if not requests and isinstance(obj, dict) and "prompt_len" not in obj and "version" in obj:
            name, source = _header(path, obj, lineno)
            continue
        try:
            req = parse_request(obj, len(requests))
        except FieldError as e:
            raise TraceError(path, e.message, line=lineno, field=e.field) from None
        if req.id in seen:
            raise TraceError(path, f"duplicate id {req.id!r}", line=lineno, field="id")
        seen.add(req.id)
        requests.append(req)
    return Trace(name, source, requests)


def _load_json(path: Path, text: str) -> Trace:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(path, f"invalid JSON: {e.msg}", line=e.lineno) from None
    if not isinstance(doc, dict):
        raise TraceError(path, "expected a JSON object with a 'requests' list", line=1)
    name, source = _header(path, doc, 1)
    items = doc.get("requests")
    if not isinstance(items, list):
        raise TraceError(path, f"expected a list, got {items!r}", line=1, field="requests")
    requests: list[TraceRequest] = []
    seen: set[str] = set()
    for i, obj in enumerate(items):
        # Line numbers are found only on error: the fast path stays one json.loads.
        try:
            req = parse_request(obj, i)
            if req.id in seen:
                raise FieldError("id", f"duplicate id {req.id!r}")
        except FieldError as e:
            line = _element_lines(text)[i]
            raise TraceError(path, e.message, line=line, field=e.field) from None
        seen.add(req.id)
        requests.append(req)
    return Trace(name, source, requests)


_WS = re.compile(r"[ \t\n\r]*")


def _element_lines(text: str) -> list[int]:
    """1-based line where each element of the top-level "requests" array starts.

    `text` is known to be valid JSON, so a scanner that only skips values with
    the stdlib decoder and counts newlines is enough.
    """
    dec = json.JSONDecoder()

    def ws(pos: int) -> int:
        return _WS.match(text, pos).end()  # type: ignore[union-attr]

    pos = ws(0) + 1  # past "{"
    while text[ws(pos)] != "}":
        key, pos = dec.raw_decode(text, ws(pos))
        pos = ws(ws(pos) + 1)  # past ":"
        if key == "requests":
            lines, pos = [], pos + 1  # past "["
            while text[ws(pos)] != "]":
                pos = ws(pos)
                lines.append(text.count("\n", 0, pos) + 1)
                _, pos = dec.raw_decode(text, pos)
                pos = ws(pos)
                pos += text[pos] == ","
            return lines
        _, pos = dec.raw_decode(text, pos)
        pos = ws(pos)
        pos += text[pos] == ","
    return []


def request_to_dict(req: TraceRequest) -> dict[str, Any]:
    """The native object of one request; default-valued optional fields are left out."""
    obj: dict[str, Any] = {
        "id": req.id,
        "arrival": req.arrival,
        "prompt_len": req.prompt_len,
        "output_len": req.output_len,
    }
    if req.prefix_blocks:
        obj["prefix_blocks"] = list(req.prefix_blocks)
        obj["prefix_block_size"] = req.prefix_block_size
    if req.priority:
        obj["priority"] = req.priority
    if req.structured:
        obj["structured"] = True
    return obj


def write_native(trace: Trace, path: str | Path) -> None:
    """Write `trace` as native JSON or JSONL, chosen by the suffix of `path`.

    Both put one request a line, so files diff well and error lines point at
    the request. JSONL starts with a header line carrying name and source.
    """
    path = Path(path)
    header = {"version": VERSION, "name": trace.name, "source": trace.source}
    rows = [json.dumps(request_to_dict(r)) for r in trace.requests]
    if path.suffix == ".jsonl":
        text = "\n".join([json.dumps(header), *rows]) + "\n"
    elif path.suffix == ".json":
        head = json.dumps(header)[:-1]  # reopen the object to append "requests"
        text = head + ',\n "requests": [\n  ' + ",\n  ".join(rows) + "\n ]}\n"
    else:
        raise ValueError(f"{path}: native traces end in .json or .jsonl")
    path.write_text(text, encoding="utf-8")
