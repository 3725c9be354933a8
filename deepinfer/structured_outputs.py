"""Structured outputs: what `SamplingParams.so_args` means, checked without a tokenizer.

`so_args = {"schema_type": kind, "schema": schema}` constrains a request's output to:

  json    a JSON Schema (a dict, or its JSON text); `{"type": "object"}` is any object.
          Output is compact JSON (", " and ": " separators, no free whitespace: a model
          cannot wander off into whitespace before the object ends).
  regex   a regular expression the whole output matches.
  ebnf    a GBNF-style grammar whose start rule is `root`.
  choice  a list of strings: the output is exactly one of them.

The grammar engine is xgrammar (the one vLLM and SGLang use), imported only when a
request has `so_args`. Parsing a grammar needs no tokenizer, so a bad schema, regex or
grammar is a ValueError at `SamplingParams` construction naming `so_args.schema` and
xgrammar's reason (with its position). Without xgrammar installed only the shape of
`so_args` is checked here; an executor that samples tokens then refuses the request.
The executor compiles the grammar against its model's tokenizer (executors/).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

SCHEMA_TYPES = ("json", "regex", "ebnf", "choice")
_WHAT = {"json": "JSON Schema", "regex": "regex", "ebnf": "EBNF grammar", "choice": "choice"}
# xgrammar's C++ errors read "[12:00:00] /project/cpp/file.cc:123: Check failed: ... : why".
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s+(Check failed: .*? is false: )?")

GrammarKey = tuple[str, str]  # (schema_type, canonical schema text)


def grammar_key(so_args: dict[str, Any]) -> GrammarKey:
    """A hashable key equal for equal grammars: compiled grammars are cached by it."""
    kind, schema = so_args["schema_type"], so_args["schema"]
    if kind == "json":
        parsed = json.loads(schema) if isinstance(schema, str) else schema
        # Key order kept: properties are generated in the schema's order.
        return kind, json.dumps(parsed, separators=(",", ":"))
    if kind == "choice":
        return kind, json.dumps(list(schema))
    return kind, schema


def check_so_args(so_args: Any) -> None:
    """ValueError naming the field when `so_args` cannot be a grammar."""
    if not isinstance(so_args, dict):
        raise ValueError(f"SamplingParams.so_args={so_args!r}: must be a dict")
    unknown = sorted(set(so_args) - {"schema_type", "schema"})
    if unknown:
        raise ValueError(
            f"SamplingParams.so_args={unknown!r}: unknown keys (expected schema_type, schema)"
        )
    kind = so_args.get("schema_type")
    if kind not in SCHEMA_TYPES:
        raise ValueError(
            f"SamplingParams.so_args.schema_type={kind!r}: expected one of {SCHEMA_TYPES}"
        )
    schema = so_args.get("schema")
    if schema is None or schema == "":
        raise ValueError(f"SamplingParams.so_args.schema={schema!r}: is required")
    _check_shape(kind, schema)
    if xgrammar_available():
        build_grammar(so_args)


def _check_shape(kind: str, schema: Any) -> None:
    def bad(why: str) -> ValueError:
        return ValueError(f"SamplingParams.so_args.schema={_short(schema)}: {why}")

    if kind == "json":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise bad(f"is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise bad("a JSON Schema must be an object (a dict) or its JSON text")
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise bad(f"is not JSON: {e}") from None
    elif kind == "choice":
        if not isinstance(schema, (list, tuple)) or not schema:
            raise bad("choice needs a non-empty list of strings")
        if not all(isinstance(c, str) for c in schema):
            raise bad("every choice must be a string")
    elif not isinstance(schema, str):
        raise bad(f"a {_WHAT[kind]} must be a string")


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def build_grammar(so_args: dict[str, Any]) -> Any:
    """The xgrammar `Grammar` of `so_args` (cached by grammar_key): parsed, not yet compiled
    for a vocabulary. ValueError naming `so_args.schema` and xgrammar's reason."""
    return _grammar(*grammar_key(so_args))


# xgrammar (0.2.9) writes the character class of a JSON string with a length bound as
# _LENIENT_CHAR, which admits raw control characters (invalid JSON); its unbounded strings
# use _JSON_CHAR. The grammar's printed EBNF is patched and parsed again.
_LENIENT_CHAR = r"[^\"\\\r\n]"
_JSON_CHAR = r"[^\0-\x1f\"\\\r\n]"


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, text: str) -> Any:
    import xgrammar as xgr

    try:
        if kind == "json":
            # strict_mode: properties a schema does not list are not generated (vLLM's default)
            grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
            ebnf = str(grammar)
            if _LENIENT_CHAR in ebnf:
                return xgr.Grammar.from_ebnf(
                    ebnf.replace(_LENIENT_CHAR, _JSON_CHAR), root_rule_name="root"
                )
            return grammar
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "ebnf":
            return xgr.Grammar.from_ebnf(text, root_rule_name="root")
        # choice: one EBNF alternative per string; JSON string escapes are EBNF's too
        return xgr.Grammar.from_ebnf(
            "root ::= " + " | ".join(json.dumps(c) for c in json.loads(text))
        )
    except Exception as e:  # xgrammar reports parse errors as RuntimeError (C++ exceptions)
        why = _reason(e)
        where = f" at {_locate(json.loads(text), why) or '/'}" if kind == "json" else ""
        raise ValueError(
            f"SamplingParams.so_args.schema={_short(text)}: invalid {_WHAT[kind]}{where}: {why}"
        ) from None


def _reason(error: Exception) -> str:
    return _CPP_PREFIX.sub("", str(error).strip()).splitlines()[0]


# Keywords whose value is a sub-schema, or a list or a name -> sub-schema map of them.
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def _locate(schema: Any, why: str, path: str = "") -> str | None:
    """The JSON pointer of the innermost sub-schema that fails alone with the same reason
    (xgrammar's messages do not say where); None when no sub-schema does."""
    if not isinstance(schema, dict):
        return None
    children: list[tuple[str, Any]] = [(k, schema[k]) for k in _SUBSCHEMA if k in schema]
    for k in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(k), list):
            children += [(f"{k}/{i}", s) for i, s in enumerate(schema[k])]
    for k in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(k), dict):
            children += [(f"{k}/{_escape(n)}", s) for n, s in schema[k].items()]
    for key, child in children:
        found = _locate(child, why, f"{path}/{key}")
        if found is not None:
            return found
    if path and _fails_with(schema, why):
        return path
    return None


def _fails_with(schema: dict[str, Any], why: str) -> bool:
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    except Exception as e:
        return _reason(e) == why
    return False


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _short(schema: Any, limit: int = 80) -> str:
    text = schema if isinstance(schema, str) else json.dumps(schema, default=repr)
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
