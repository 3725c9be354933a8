"""Structured outputs: constrain generation with `SamplingParams(so_args=...)`.

    python examples/structured_outputs.py [--model DIR_OR_HUB_ID] [--device cpu|cuda]

Every kind of `so_args`: a JSON Schema (and any JSON object), a regular expression,
a GBNF-style grammar and a list of choices. The grammar engine is xgrammar
(`pip install xgrammar`), working on the model's own tokenizer; a request ends with
finish reason "stop" as soon as its grammar is complete. The demo model that ships
with deepinfer was trained on Python source, not JSON, so its values are odd, but
they always parse: the mask allows nothing else. A bad schema is a ValueError that
names the field and where it is wrong.
"""

from __future__ import annotations

import argparse
import json

from deepinfer import LLM, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {
            "type": "array",
            "items": {"enum": ["python", "c", "rust"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "languages"],
}
ARITHMETIC = r"""
root ::= term ((" + " | " - ") term){0,4}
term ::= num | "(" num " * " num ")"
num ::= [1-9] [0-9]{0,2}
"""
CASES = [
    ("a JSON Schema", {"schema_type": "json", "schema": PERSON}),
    ("any JSON object", {"schema_type": "json", "schema": {"type": "object"}}),
    (
        "a regex (a date)",
        {"schema_type": "regex", "schema": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][1-9]"},
    ),
    ("a grammar (EBNF)", {"schema_type": "ebnf", "schema": ARITHMETIC}),
    ("a choice", {"schema_type": "choice", "schema": ["yes", "no", "it depends"]}),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="deepinfer-demo")
    p.add_argument("--device", default=None)
    p.add_argument("--max-tokens", type=int, default=96)
    args = p.parse_args()
    llm = LLM(args.model, device=args.device, max_num_seqs=8)
    prompt = "# an example record\nrecord = "
    params = [
        SamplingParams(temperature=0.8, max_tokens=args.max_tokens, seed=i, so_args=so_args)
        for i, (_, so_args) in enumerate(CASES)
    ]
    for (what, _), out in zip(CASES, llm.generate([prompt] * len(CASES), params)):
        completion = out.outputs[0]
        print(f"--- {what} ({len(completion.token_ids)} tokens, {completion.finish_reason})")
        print(completion.text)
    person = json.loads(llm.generate(prompt, params[0])[0].outputs[0].text)
    print(f"--- parsed: {person['name']!r} is {person['age']}")

    try:  # found at SamplingParams, before anything is queued
        SamplingParams(so_args={"schema_type": "json", "schema": {"type": "integr"}})
    except ValueError as e:
        print(f"--- a bad schema: {e}")


if __name__ == "__main__":
    main()
