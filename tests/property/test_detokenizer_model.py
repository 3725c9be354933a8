"""The streaming detokenizer (`IncrementalDetokenizer`) against a reference that decodes
the whole sequence at once (docs/design.md, "Stop conditions"; vLLM's incremental
detokenization and stop strings).

A toy byte-level tokenizer makes the cases a real one makes: characters of two to four
UTF-8 bytes split over several tokens (each part alone decodes to U+FFFD), special
tokens that are skipped or kept, and kept ones joined to their neighbours by a space
when the tokenizer says which they are (vLLM's `spaces_between_special_tokens`). The
reference never runs a window: after each `append` the text is the whole prompt plus
output decoded at once, less the prompt's own text, up to the last whole character;
the stop rule is restated from the specification:
- a stop string counts once the output has `min_tokens` tokens; the first `append`
  whose new characters complete one ends the text, cut before the earliest-starting
  stop string completed there (ties: the first listed, vLLM's list order), or after it
  with `include_stop_str_in_output`; later appends add nothing;
- the text `append` returns is final: its concatenation is a prefix of the text, short
  of it by exactly the longest stop string less one character while no stop string
  has ended it (by nothing with `include_stop_str_in_output`), and `flush` returns the
  rest;
- every default is vLLM's: special tokens skipped, stop strings cut, special tokens
  spaced, no `min_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.detokenizer import IncrementalDetokenizer
from tests.property.strategies import at_least

# Whole pieces (one token each), chosen to overlap so stop strings span tokens.
PIECES = ["a", "b", "ab", " ", " a", "ba", " b", "aba", "\n", "é", "€", "😀"]
SPECIALS = {100: "<s>", 101: "</s>"}
# Byte tokens: id 200 + b is the single byte b (the parts of a split character).
BYTE_BASE = 200


def token_bytes(t: int) -> bytes:
    if t in SPECIALS:
        return SPECIALS[t].encode()
    if t >= BYTE_BASE:
        return bytes([t - BYTE_BASE])
    return PIECES[t].encode()


class ByteTokenizer:
    """Decodes by concatenating token bytes (UTF-8, invalid bytes as U+FFFD); special
    tokens are dropped with skip_special_tokens, their text otherwise. Like the
    `tokenizers` binding, it takes only a bool for skip_special_tokens."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        assert isinstance(skip_special_tokens, bool), f"skip_special_tokens={skip_special_tokens!r}"
        kept = [t for t in ids if not (skip_special_tokens and t in SPECIALS)]
        return b"".join(token_bytes(t) for t in kept).decode("utf-8", errors="replace")


class ByteTokenizerWithSpecials(ByteTokenizer):
    """The same, and says which tokens are special (as `deepinfer.tokenizer.Tokenizer`)."""

    special_ids = frozenset(SPECIALS)


class LeadingSpaceTokenizer(ByteTokenizer):
    """The same, but a sequence's text loses its leading space, as a SentencePiece
    (Metaspace) decoder drops the first token's: what the prompt context and the
    decoding window exist for."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = super().decode(ids, skip_special_tokens)
        return text[1:] if text.startswith(" ") else text


TOKENIZERS = {
    "plain": ByteTokenizer,
    "lists specials": ByteTokenizerWithSpecials,
    "leading space": LeadingSpaceTokenizer,
}
# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: the prompt tokens that give the first
# output tokens their context.
PROMPT_CONTEXT = 5


@dataclass
class Unit:
    """One character or special token of the text, and the tokens that make it."""

    tokens: list[int]
    special: bool = False


@st.composite
def units(draw: st.DrawFn, max_size: int) -> list[Unit]:
    """Characters (a whole-piece token, or a multi-byte character as its byte tokens)
    and special tokens."""
    out = []
    for _ in range(draw(st.integers(0, max_size))):
        kind = draw(st.integers(0, 9))
        if kind <= 4:
            out.append(Unit([draw(st.integers(0, len(PIECES) - 1))]))
        elif kind <= 6:
            char = draw(st.sampled_from(["é", "€", "😀"]))
            out.append(Unit([BYTE_BASE + b for b in char.encode()]))
        else:
            out.append(Unit([draw(st.sampled_from(sorted(SPECIALS)))], special=True))
    return out


def reference_decode(ids: list[int], skip: bool, spaced: bool, tokenizer: str) -> str:
    """The whole sequence decoded at once: with `spaced`, each kept special token is its
    own part and the parts are joined by a space."""
    if not spaced:
        return TOKENIZERS[tokenizer]().decode(ids, skip_special_tokens=skip)
    parts: list[str] = []
    run: list[int] = []
    for t in ids:
        if t in SPECIALS:
            if run:
                parts.append(ByteTokenizer().decode(run, skip_special_tokens=False))
                run = []
            parts.append(SPECIALS[t])
        else:
            run.append(t)
    if run:
        parts.append(ByteTokenizer().decode(run, skip_special_tokens=False))
    return " ".join(parts)


@dataclass
class Options:
    """The detokenizer's options, each either passed or left to its default (None)."""

    skip: bool | None
    include_stop: bool | None
    spaces: bool | None
    min_tokens: int | None
    tokenizer: str

    def kwargs(self) -> dict[str, Any]:
        names = {
            "skip_special_tokens": self.skip,
            "include_stop_str_in_output": self.include_stop,
            "spaces_between_special_tokens": self.spaces,
            "min_tokens": self.min_tokens,
        }
        return {k: v for k, v in names.items() if v is not None}

    @property
    def effective_skip(self) -> bool:
        return True if self.skip is None else self.skip

    @property
    def spaced(self) -> bool:
        spaces = True if self.spaces is None else self.spaces
        return self.tokenizer == "lists specials" and not self.effective_skip and spaces


@st.composite
def stop_strings(draw: st.DrawFn, text: str) -> list[str]:
    """Zero to three stop strings: mostly pieces of the text it will make (so they are
    found, often across tokens), sometimes text it never makes, or the empty string
    (ignored)."""
    out = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.integers(0, 5))
        if kind <= 3 and text:
            i = draw(st.integers(0, len(text) - 1))
            out.append(text[i : i + draw(st.integers(1, 4))])
        elif kind == 4:
            out.append("\x00" + draw(st.text(alphabet="ab", max_size=2)))
        else:
            out.append("")
    return out


def cut_at_stop(text: str, before: int, stops: list[str], include: bool) -> tuple[str, str] | None:
    """The stop rule on a text that grew past its first `before` characters: the
    earliest-starting stop string that ends past them (ties: the first listed, vLLM's
    list order) and the text cut before it (after it with `include`); None if none ends
    there."""
    found = [
        (i, k, s)
        for k, s in enumerate(stops)
        if (i := text.find(s, max(0, before - len(s) + 1))) >= 0
    ]
    if not found:
        return None
    i, _, s = min(found)
    return s, text[: i + len(s) if include else i]


def whole_prefix(units_: list[Unit], ntok: int) -> list[int]:
    """The tokens of the units complete within the first `ntok` output tokens."""
    ids: list[int] = []
    for u in units_:
        if len(ids) + len(u.tokens) > ntok:
            break
        ids.extend(u.tokens)
    return ids


@pytest.mark.parametrize("tokenizer", sorted(TOKENIZERS))
@at_least(300)
@given(data=st.data())
def test_streamed_text_matches_the_whole_decode_cut_at_the_first_stop_string(
    tokenizer: str, data: Any
) -> None:
    """After every `append`, `text`, `stop_hit` and `token_ids` are the reference's: the
    output's whole characters decoded at once in the prompt's context, cut at the stop
    rule; what `append` returned is final and holds back exactly the longest stop string
    less one character until a stop string ends it; `flush` returns the rest."""
    opts = Options(
        skip=data.draw(st.sampled_from([None, True, False]), label="skip_special_tokens"),
        include_stop=data.draw(st.sampled_from([None, False, True]), label="include_stop"),
        spaces=data.draw(st.sampled_from([None, True, False]), label="spaces"),
        min_tokens=data.draw(st.one_of(st.none(), st.integers(0, 12)), label="min_tokens"),
        tokenizer=tokenizer,
    )
    prompt_units = data.draw(units(7), label="prompt")
    out_units = data.draw(units(14), label="output")
    prompt = [t for u in prompt_units for t in u.tokens]
    out = [t for u in out_units for t in u.tokens]
    # A request may end inside a character: its last bytes are never decoded.
    cut = data.draw(st.integers(max(0, len(out) - 3), len(out)), label="cut")
    out = out[:cut]
    skip, spaced = opts.effective_skip, opts.spaced
    context = prompt[-PROMPT_CONTEXT:]
    context_text = reference_decode(context, skip, spaced, opts.tokenizer)

    def text_of(ntok: int) -> str:
        """The output text after `ntok` output tokens: its whole characters only."""
        ids = context + whole_prefix(out_units, ntok)
        whole = reference_decode(ids, skip, spaced, opts.tokenizer)
        assert whole.startswith(context_text)
        return whole[len(context_text) :]

    stops = data.draw(stop_strings(text_of(len(out))), label="stop")
    include = bool(opts.include_stop)
    min_tokens = opts.min_tokens or 0
    live = [s for s in stops if s]
    hold = 0 if include or not live else max(len(s) for s in live) - 1
    detok = IncrementalDetokenizer(
        TOKENIZERS[opts.tokenizer](), list(prompt), stop=stops or None, **opts.kwargs()
    )
    assert (detok.text, detok.stop_hit, detok.token_ids) == ("", None, [])

    boundaries = {len(whole_prefix(out_units, k)) for k in range(len(out) + 1)}
    fed = 0
    streamed = ""
    want_hit: str | None = None
    want_text = ""
    want_tokens: list[int] = []
    while fed < len(out):
        # Mostly one token (as the output processor feeds them), else a few at once.
        n = data.draw(st.sampled_from([1, 1, 2, 3]), label="tokens this append")
        group = out[fed : fed + n]
        fed += len(group)
        ended_before = want_hit is not None  # a stopped detokenizer takes no more tokens
        # Text grows only at an append that ends on a whole character.
        if not ended_before and fed in boundaries:
            before, now = want_text, text_of(fed)
            want_text = now
            if len(now) > len(before) and fed >= min_tokens:
                cut = cut_at_stop(now, len(before), live, include)
                if cut is not None:
                    want_hit, want_text = cut
        if not ended_before:
            want_tokens = out[:fed]
        delta = detok.append(group)
        where = f"after {fed} tokens {out[:fed]} (prompt {prompt}, stops {stops}, {opts})"
        assert (detok.text, detok.stop_hit) == (want_text, want_hit), (
            where
            + f": text {detok.text!r} on {detok.stop_hit!r}, want {want_text!r} on {want_hit!r}"
        )
        assert detok.token_ids == want_tokens, where
        streamed += delta
        final_len = len(want_text) if want_hit is not None else max(len(want_text) - hold, 0)
        assert streamed == want_text[:final_len], (
            where + f": streamed {streamed!r}, want {want_text[:final_len]!r}"
        )
    assert streamed + detok.flush() == detok.text
    assert detok.flush() == ""
