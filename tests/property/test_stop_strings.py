"""Stop strings on the real CPU executor with the shipped demo model (docs/design.md,
"Stop conditions"): hypothesis draws stop strings from the model's own greedy
continuation, most of them spanning token boundaries, and the generation must end on
the token that completes the first one (at or after min_tokens), its text cut before
it. One model load for the module; each example is one short greedy generation.

Broken copies that fail it: `IncrementalDetokenizer._find_stop` searching from
`before` instead of `before - len(s) + 1` (a stop string spanning tokens missed);
`LLM._run` not finishing the request when `feed()` reports a stop (generation runs on
to max_tokens); `len(self.token_ids) > self._min_tokens` in `append`.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from deepinfer import LLM, SamplingParams  # noqa: E402
from executors.demo import DEMO_MODEL_DIR  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (DEMO_MODEL_DIR / "model.safetensors").is_file(), reason="demo checkpoint not built"
)
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\nclass ", "    # compute the "]
MAX_TOKENS = 20


class Free:
    """A prompt's greedy continuation with no stop string: its tokens and the text after
    each prefix of them (decoded independently of the engine's detokenizer)."""

    def __init__(self, llm: LLM, prompt: str) -> None:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        out = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
        self.prompt, self.ids, self.text = prompt, list(out.token_ids), out.text
        tok = llm.tokenizer
        self.texts = [tok.decode(self.ids[:k]) for k in range(len(self.ids) + 1)]
        assert self.texts[-1] == self.text, "the engine's text is not the tokens' text"

    def expected_end(self, stops: list[str], min_tokens: int) -> tuple[int, str | None, str]:
        """(output tokens, stop string, text): the first token k >= min_tokens whose new
        text completes a stop string ends it; the text is cut at the earliest-starting
        stop string completed then."""
        for k in range(max(min_tokens, 1), len(self.ids) + 1):
            before, text = len(self.texts[k - 1]), self.texts[k]
            if len(text) == before or text.endswith("\ufffd"):
                continue  # no whole new character yet: the detokenizer waits
            found = [(i, s) for s in stops if (i := text.find(s, max(0, before - len(s) + 1))) >= 0]
            if found:
                i, s = min(found)
                return k, s, text[:i]
        return len(self.ids), None, self.text


@pytest.fixture(scope="module")
def demo() -> tuple[LLM, list[Free]]:
    llm = LLM(str(DEMO_MODEL_DIR), device="cpu", enable_prefix_caching=False)
    return llm, [Free(llm, p) for p in PROMPTS]


@st.composite
def stop_strings(draw: st.DrawFn, free: Free) -> list[str]:
    """One to three stop strings: mostly a few characters either side of a token
    boundary of the continuation, sometimes any substring, or text it never makes."""
    out = []
    ends = [len(t) for t in free.texts[1:-1]]  # character offsets of token boundaries
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 3))
        if kind <= 1 and ends:
            b = draw(st.sampled_from(ends))
            s = free.text[max(0, b - draw(st.integers(1, 4))) : b + draw(st.integers(1, 4))]
        elif kind == 2:
            i = draw(st.integers(0, len(free.text) - 1))
            s = free.text[i : i + draw(st.integers(1, 6))]
        else:
            s = "\x00" + draw(st.text(min_size=0, max_size=2))
        out.append(s)
    return out


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_a_stop_string_ends_the_request_on_the_token_that_completes_it(
    demo: tuple[LLM, list[Free]], data: Any
) -> None:
    """The request ends with finish reason "stop" on the first token (at or after
    min_tokens) that completes one of its stop strings, spanning token boundaries or
    not; its token ids are the greedy continuation up to that token, its text that
    continuation cut where the stop string starts, and stop_reason names the string.
    With no stop string in the continuation it runs to max_tokens. Either way its
    record says finished (`finish_request__mutmut_6`, every end from outside counted as
    an abort, failed it)."""
    llm, frees = demo
    free = frees[data.draw(st.integers(0, len(frees) - 1), label="prompt")]
    stops = data.draw(stop_strings(free), label="stop")
    min_tokens = data.draw(st.sampled_from([0, 0, 3, 8]), label="min_tokens")
    sp = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=stops, min_tokens=min_tokens
    )
    out = llm.generate(free.prompt, sp, use_tqdm=False)[0].outputs[0]
    k, s, text = free.expected_end(stops, min_tokens)
    where = f"prompt {free.prompt!r}, stops {stops}, min_tokens {min_tokens}: "
    assert list(out.token_ids) == free.ids[:k], where + f"tokens {out.token_ids}, want {k} tokens"
    assert out.text == text, where + f"text {out.text!r}, want {text!r}"
    want_reason = "stop" if s is not None else "length"
    assert (out.finish_reason, out.stop_reason) == (want_reason, s), (
        where + f"finish {out.finish_reason} on {out.stop_reason!r}, want {want_reason} on {s!r}"
    )
    record = llm.engine.records[-1]  # ended by the stop string: finished, not aborted
    assert (record.status, record.finish_reason) == ("finished", want_reason), where + str(record)
