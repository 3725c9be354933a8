"""Structured outputs end to end on the demo model (CPU): every so_args type constrains
real sampling at temperature 1.0, outputs validate, a walk of allowed tokens never leaves
its grammar, and a bad or slow grammar disturbs no other request."""

from __future__ import annotations

import functools
import json
import re
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.structured_outputs import build_grammar  # noqa: E402
from deepinfer.tokenizer import load_tokenizer  # noqa: E402
from executors.demo import DEMO_MODEL_DIR  # noqa: E402
from executors.grammar_vocab import tokenizer_info  # noqa: E402
from executors.structured_outputs import GrammarCompiler, GrammarState  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (DEMO_MODEL_DIR / "model.safetensors").is_file(), reason="demo checkpoint not built"
)

SCHEMAS = {
    "required fields": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    "nested objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
                },
                "required": ["id", "email"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "arrays of enums": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "level": {"enum": ["low", "mid", "high"]},
        },
        "required": ["tags", "level"],
    },
    "bounded numbers": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -10, "maximum": 10},
            "y": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "n": {"type": "integer", "minimum": 100, "maximum": 999},
        },
        "required": ["x", "y", "n"],
    },
    "array of objects": {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": -50, "maximum": 50},
                        "y": {"type": "integer", "minimum": -50, "maximum": 50},
                    },
                    "required": ["x", "y"],
                },
            }
        },
        "required": ["points"],
    },
}
REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(cat|dog)s? [a-z]{1,6}",
    r"[A-Z][a-z]{2,7}( [A-Z][a-z]{2,7}){0,2}",
    r"\d{1,3}\.\d{2}",
]
# Sums of numbers and bracketed sums, nesting bounded so every output ends.
ARITH = r"""
root ::= term ((" + " | " - ") term){0,3}
term ::= num | "(" num ((" + " | " - ") num){1,2} ")"
num ::= [1-9] [0-9]{0,2}
"""
CHOICES = ["yes", "no", "maybe", "it depends"]
PROMPTS = ["def f(x):\n", "import json\n", "class A:\n    ", "x = "]


def parses_as_arith(text: str) -> bool:
    """A recursive-descent parser of ARITH (independent of xgrammar)."""
    pos = 0

    def num() -> bool:
        nonlocal pos
        m = re.compile(r"[1-9][0-9]{0,2}").match(text, pos)
        if m is None:
            return False
        pos = m.end()
        return True

    def ops(item, lo: int, hi: int) -> bool:  # type: ignore[no-untyped-def]
        nonlocal pos
        count = 0
        while count < hi and text.startswith((" + ", " - "), pos):
            pos += 3
            if not item():
                return False
            count += 1
        return count >= lo

    def term() -> bool:
        nonlocal pos
        if text.startswith("(", pos):
            pos += 1
            ok = num() and ops(num, 1, 2) and text.startswith(")", pos)
            pos += 1
            return ok
        return num()

    return term() and ops(term, 0, 3) and pos == len(text)


def valid(so_args: dict, text: str) -> bool:
    kind, schema = so_args["schema_type"], so_args["schema"]
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(schema, text) is not None
    if kind == "ebnf":
        return parses_as_arith(text)
    return text in schema


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("deepinfer-demo", device="cpu")


def _generate(llm: LLM, so_args: list[dict], max_tokens: int = 96) -> list:
    sps = [SamplingParams(temperature=1.0, max_tokens=max_tokens, so_args=a) for a in so_args]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(sps))]
    return [o.outputs[0] for o in llm.generate(prompts, sps, use_tqdm=False)]


def test_200_generations_under_5_json_schemas_all_parse_and_validate(llm: LLM) -> None:
    so_args = [{"schema_type": "json", "schema": s} for s in SCHEMAS.values() for _ in range(40)]
    outs = _generate(llm, so_args)
    bad = [(a["schema"], o.text) for a, o in zip(so_args, outs) if not valid(a, o.text)]
    assert not bad
    # Each ended when its grammar did: reason stop, no end token needed, no stop token id.
    assert {(o.finish_reason, o.stop_reason) for o in outs} == {("stop", None)}


def test_regex_outputs_full_match_ebnf_outputs_parse_choices_are_choices(llm: LLM) -> None:
    so_args = (
        [{"schema_type": "regex", "schema": r} for r in REGEXES for _ in range(5)]
        + [{"schema_type": "ebnf", "schema": ARITH}] * 10
        + [{"schema_type": "choice", "schema": CHOICES}] * 10
    )
    outs = _generate(llm, so_args, max_tokens=48)
    assert [o.finish_reason for o in outs] == ["stop"] * len(outs)
    assert [(a["schema"], o.text) for a, o in zip(so_args, outs) if not valid(a, o.text)] == []
    assert len({o.text for o in outs[-10:]}) > 1  # sampled, not forced to one answer


def test_any_json_object_and_max_tokens_still_bounding_an_open_grammar(llm: LLM) -> None:
    any_object = {"schema_type": "json", "schema": {"type": "object"}}
    outs = _generate(llm, [any_object] * 6, max_tokens=160)
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:  # cut by max_tokens mid-object: still a prefix of one
            assert o.finish_reason == "length" and o.text.startswith("{")
    assert any(o.finish_reason == "stop" for o in outs)
    (word,) = _generate(llm, [{"schema_type": "regex", "schema": "[a-z]+"}], max_tokens=5)
    assert len(word.token_ids) <= 5 and re.fullmatch("[a-z]*", word.text)


@pytest.mark.parametrize(
    "engine_args",
    [dict(async_scheduling=True), dict(num_gpu_blocks=24, block_size=4, max_num_seqs=16)],
    ids=["async", "preempting"],
)
def test_async_scheduling_and_preemption_keep_outputs_valid(engine_args: dict) -> None:
    llm = LLM("deepinfer-demo", device="cpu", **engine_args)
    so_args = [{"schema_type": "json", "schema": s} for s in SCHEMAS.values() for _ in range(3)]
    outs = _generate(llm, so_args)
    assert all(valid(a, o.text) for a, o in zip(so_args, outs))
    if "num_gpu_blocks" in engine_args:  # resumed matchers replayed their history
        assert llm.engine.scheduler.num_preemptions > 0


def test_a_bad_schema_is_refused_before_anything_is_queued(llm: LLM) -> None:
    good = SamplingParams(temperature=0.0, max_tokens=4)
    sneaked = SamplingParams(temperature=0.0, max_tokens=4)
    sneaked.so_args = {"schema_type": "regex", "schema": "[0-9"}  # set after validation
    with pytest.raises(ValueError, match=r"so_args\.schema='\[0-9': invalid regex: .*position"):
        llm.generate(["a", "b"], [good, sneaked], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.generate(["a"], good, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_a_grammar_failing_to_compile_rejects_its_request_and_the_others_finish(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    import executors.structured_outputs as so

    real = so.build_grammar
    broken = {"schema_type": "regex", "schema": "[xyz]{2}"}
    # A grammar that passes parsing but fails in the compile worker (here: not a grammar).
    monkeypatch.setattr(so, "build_grammar", lambda a: "not a grammar" if a == broken else real(a))
    so_args = [broken, *[{"schema_type": "choice", "schema": CHOICES}] * 3]
    outs = llm.generate(
        PROMPTS,
        [SamplingParams(temperature=1.0, max_tokens=8, so_args=a) for a in so_args],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].finish_reason == "rejected"
    assert outs[0].error.startswith("so_args: the grammar failed to compile: ")
    assert all(o.outputs[0].text in CHOICES for o in outs[1:])


def test_compiling_does_not_hold_up_other_requests(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = {"schema_type": "regex", "schema": "slow[0-9]"}
    free_done = threading.Event()
    real_compile = xgr.GrammarCompiler.compile_grammar

    def compile_grammar(self, grammar, *args, **kwargs):  # type: ignore[no-untyped-def]
        if grammar is build_grammar(slow):  # (parsed grammars are cached: the same object)
            assert free_done.wait(60)  # until the unconstrained request has finished
        return real_compile(self, grammar, *args, **kwargs)

    monkeypatch.setattr(xgr.GrammarCompiler, "compile_grammar", compile_grammar)
    real_apply = llm.engine.apply_results

    def apply_results(out, res, duration=None, **kwargs):  # type: ignore[no-untyped-def]
        changed = real_apply(out, res, duration, **kwargs)
        if any(r.is_finished for r in changed):  # only the free one can: the other waits
            free_done.set()
        return changed

    monkeypatch.setattr(llm.engine, "apply_results", apply_results)
    sps = [
        SamplingParams(temperature=1.0, max_tokens=8, so_args=slow),
        SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),
    ]
    t0 = time.monotonic()
    constrained, free = llm.generate(["a = ", "b = "], sps, use_tqdm=False)
    assert time.monotonic() - t0 < 60
    assert re.fullmatch("slow[0-9]", constrained.outputs[0].text)
    assert free.metrics.finished_time < constrained.metrics.first_scheduled_time


@pytest.fixture(scope="module")
def demo_compiler() -> GrammarCompiler:
    return GrammarCompiler(DEMO_MODEL_DIR, 8192, [1])


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    # 64 ids past the tokenizer's 8,192 (a padded lm_head): never allowed.
    return GrammarCompiler(DEMO_MODEL_DIR, 8192 + 64, [1])


@pytest.mark.parametrize("bound", [{}, {"maxLength": 12}, {"minLength": 1, "maxLength": 12}])
def test_a_json_string_admits_no_raw_control_character(bound: dict) -> None:
    """JSON forbids U+0000..U+001F unescaped in a string; xgrammar 0.2.9's rule for a string
    with a length bound let them through (the random walk below found '"\x00"')."""
    schema = {"type": "object", "properties": {"name": {"type": "string", **bound}},
              "required": ["name"]}  # fmt: skip
    grammar = build_grammar({"schema_type": "json", "schema": schema})
    accepts = xgr.testing._is_grammar_accept_string
    assert accepts(grammar, '{"name": "ab"}')
    for char in "\x00\x1f\t":
        assert not accepts(grammar, '{"name": "a' + char + '"}'), repr(char)


WALK_GRAMMARS = [
    *({"schema_type": "json", "schema": s} for s in SCHEMAS.values()),
    *({"schema_type": "regex", "schema": r} for r in REGEXES),
    {"schema_type": "ebnf", "schema": ARITH},
    {"schema_type": "choice", "schema": CHOICES},
]


def allowed_ids(row: torch.Tensor, vocab_size: int) -> list[int]:
    """The ids a bitmask row ([words] int32, bit i of word w: id 32 * w + i) allows."""
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return bits.nonzero()[0].tolist()


@functools.cache
def demo_tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(DEMO_MODEL_DIR)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(WALK_GRAMMARS), st.lists(st.integers(0, 1 << 30), max_size=80))
def test_a_random_walk_of_allowed_tokens_never_leaves_the_grammar(
    compiler: GrammarCompiler, so_args: dict, picks: list[int]
) -> None:
    tok = demo_tokenizer()
    state = GrammarState(compiler.compiled(so_args))
    bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
    tokens: list[int] = []
    for pick in picks:
        if state.done:
            break
        state.fill(bitmask, 0)
        ids = allowed_ids(bitmask[0], compiler.vocab_size)
        assert ids and not {0, 2} & set(ids) and max(ids) < 8192  # no special, no padding id
        token = ids[pick % len(ids)]
        assert state.accept([token]) == 1
        tokens.append(token)
        if state.matcher.is_completed():  # whatever it accepted so far is a whole output
            assert valid(so_args, tok.decode([t for t in tokens if t != 1])), tokens
    if state.done:
        assert state.matcher.is_completed()


def test_added_and_special_tokens_get_their_real_bytes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    raw.add_tokens(["hello world"])  # an added, non-special token: stored as plain text
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        (DEMO_MODEL_DIR / "tokenizer_config.json").read_text()
    )
    info = tokenizer_info(load_tokenizer(tmp_path), 8192 + 64, [1])
    decoded = info.decoded_vocab
    assert decoded[8192] == b"hello world"
    assert decoded[0] == decoded[2] == decoded[8200] == b""  # BOS, padding, past the end
    assert decoded[300] == b" p"  # byte-level 'Ġp'


def _drafting_runner(compiler: GrammarCompiler):  # type: ignore[no-untyped-def]
    from tests.executors.harness import load_runner

    runner = load_runner(DEMO_MODEL_DIR, block_size=4, num_blocks=16, num_speculative_tokens=3)
    assert runner.vocab_size == 8192
    runner.requests.grammars = compiler
    return runner


def _step(req_id: str, pos: int, tokens: list[int], drafts: list[int] = (), **kw):  # type: ignore[no-untyped-def,assignment]
    from deepinfer.outputs import ScheduledRequest

    return ScheduledRequest(
        req_id=req_id,
        num_tokens=len(tokens) + len(drafts),
        num_computed_tokens=pos,
        is_prompt=pos == 0,
        will_sample=True,
        new_block_ids=kw.get("block_table", []),
        token_ids=list(tokens) + list(drafts),
        draft_token_ids=list(drafts),
        num_prompt_tokens=len(tokens) if pos == 0 else 0,
        **kw,
    )


def test_drafts_are_checked_against_the_grammar_and_the_matcher_rolled_back(
    demo_compiler: GrammarCompiler,
) -> None:
    """Greedy under a regex, verifying drafts: the grammar's own continuation is accepted
    whole; a draft it forbids ends acceptance there (the token sampled in its row obeys
    the grammar) and the matcher is back where the accepted tokens put it; tokens the
    model accepts past the grammar's end are dropped and the request is complete."""
    from deepinfer.outputs import SchedulerOutput

    tok = load_tokenizer(DEMO_MODEL_DIR)
    regex = SamplingParams(temperature=0.0, so_args={"schema_type": "regex", "schema": REGEXES[0]})
    prompt, table = tok.encode("x = "), [0, 1, 2, 3]

    def start():  # type: ignore[no-untyped-def]
        runner = _drafting_runner(demo_compiler)
        first = _step("a", 0, prompt, block_table=table, sampling_params=regex)
        return runner, runner.execute(SchedulerOutput(0, [first])).sampled_token_ids["a"]

    runner, ref = start()  # the constrained greedy continuation, one token a step
    while True:
        res = runner.execute(
            SchedulerOutput(len(ref), [_step("a", len(prompt) + len(ref) - 1, ref[-1:])])
        )
        ref += res.sampled_token_ids["a"]
        if res.completed_req_ids:
            break
    assert re.fullmatch(REGEXES[0], tok.decode(ref)) and len(ref) >= 5

    runner, first = start()
    res = runner.execute(SchedulerOutput(1, [_step("a", len(prompt), first, ref[1:4])]))
    assert res.sampled_token_ids["a"] == ref[1:5]
    assert res.completed_req_ids == (set() if len(ref) > 5 else {"a"})

    runner, first = start()
    res = runner.execute(SchedulerOutput(1, [_step("a", len(prompt), first, [ref[1], 0, ref[3]])]))
    assert res.sampled_token_ids["a"] == ref[1:3]  # BOS (0) is never allowed
    assert runner.requests["a"].grammar.num_accepted == 3
    res = runner.execute(SchedulerOutput(2, [_step("a", len(prompt) + 2, ref[2:3], ref[3:4])]))
    assert res.sampled_token_ids["a"] == ref[3:5]

    # The unconstrained greedy token after the whole output, drafted past the grammar's end.
    greedy = SamplingParams(temperature=0.0)
    plain = _drafting_runner(demo_compiler)
    whole = _step("b", 0, prompt + ref, block_table=table, sampling_params=greedy)
    after = plain.execute(SchedulerOutput(0, [whole]))
    runner, first = start()
    split = len(ref) - 2
    res = runner.execute(SchedulerOutput(1, [_step("a", len(prompt), first, ref[1:split])]))
    assert res.sampled_token_ids["a"] == ref[1 : split + 1] and not res.completed_req_ids
    drafts = ref[split + 1 :] + after.sampled_token_ids["b"]
    res = runner.execute(
        SchedulerOutput(2, [_step("a", len(prompt) + split, ref[split : split + 1], drafts)])
    )
    assert res.sampled_token_ids["a"] == ref[split + 1 :] and res.completed_req_ids == {"a"}


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_on_cuda_with_decode_graphs_every_output_obeys_its_grammar(async_scheduling: bool) -> None:
    """The CUDA path: decode steps replay graphs, the bitmask goes through a pinned
    buffer to the device and the logits are masked there."""
    llm = LLM("deepinfer-demo", device="cuda", async_scheduling=async_scheduling)
    assert llm.executor.runner.graphs is not None
    so_args = [{"schema_type": "json", "schema": s} for s in SCHEMAS.values() for _ in range(8)]
    so_args += [{"schema_type": "regex", "schema": r} for r in REGEXES for _ in range(4)]
    so_args += [{"schema_type": "ebnf", "schema": ARITH}] * 8
    outs = _generate(llm, so_args)
    assert [(a["schema"], o.text) for a, o in zip(so_args, outs) if not valid(a, o.text)] == []
    assert {o.finish_reason for o in outs} == {"stop"}


def test_a_checkpoint_without_tokenizer_json_gets_the_same_vocabulary(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """vocab.json + merges.txt (transformers' AutoTokenizer, as tiktoken or sentencepiece
    checkpoints load): xgrammar reads it, special tokens still never allowed."""
    raw = json.loads((DEMO_MODEL_DIR / "tokenizer.json").read_text())
    (tmp_path / "vocab.json").write_text(json.dumps(raw["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    config = json.loads((DEMO_MODEL_DIR / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    legacy = load_tokenizer(tmp_path)
    assert legacy.serialized() is None  # not the tokenizer.json path
    size = 8192 + 64
    got = tokenizer_info(legacy, size, [1])
    want = tokenizer_info(demo_tokenizer(), size, [1])
    assert got.decoded_vocab == want.decoded_vocab and got.stop_token_ids == [1]
    assert got.decoded_vocab[:3] == [b"", b"", b""] and got.decoded_vocab[300] == b" p"


def test_a_grammar_that_allows_nothing_more_ends_the_output_under_min_tokens(llm: LLM) -> None:
    """min_tokens holds the end tokens back, but a complete grammar that allows nothing
    more leaves no token to sample: the output ends there ("stop"), neither an error nor
    a token outside the grammar."""
    choice = {"schema_type": "choice", "schema": ["yes", "no"]}
    sp = SamplingParams(temperature=0.0, max_tokens=12, so_args=choice, min_tokens=10)
    (out,) = [o.outputs[0] for o in llm.generate(PROMPTS[:1], [sp], use_tqdm=False)]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
