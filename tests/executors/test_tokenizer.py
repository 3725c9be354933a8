"""Tokenizer loading and incremental detokenization, on a small byte-level BPE built here."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from deepinfer.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

BOS, EOS, EOT = "<|bos|>", "<|eos|>", "<|eot|>"
WORDS = [
    "héllo",
    "wörld",
    "日本語",
    "🙂",
    "naïve",
    "café",
    "привет",
    "мир",
    "中文",
    "字符",
    "👍🏽",
    "Ωmega",
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "tokens",
    "stream",
    "über",
    "ß",
    "ñandú",
    "한국어",
    "emoji😀",
    "x",
    "1234",
    "\n",
]
TEXTS = [
    "héllo wörld 日本語 🙂",
    "the quick brown fox jumps over the lazy dog",
    "naïve café 中文字符 👍🏽 привет мир",
    "한국어 ñandú über 😀😀 Ωmega\nnew line",
    "rare: 龘 𝄞 ∮ 🦜🦜 ǅ",
]


def _corpus(n: int = 400) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def _raw_tokenizer() -> RawTokenizer:
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=[BOS, EOS, EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    _raw_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": BOS,
                "add_bos_token": True,
                "eos_token": {"__type": "AddedToken", "content": EOS, "special": True},
            }
        )
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    return d


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return load_tokenizer(model_dir)


def stream(
    tok: Tokenizer,
    ids: list[int],
    chunks: list[int] | None = None,
    prompt: list[int] | None = None,
    **kw: bool | int | list[str],
) -> tuple[IncrementalDetokenizer, str]:
    """Feed ids (one at a time, or in the given chunk sizes); return the detokenizer and
    everything it emitted, flush included."""
    detok = IncrementalDetokenizer(tok, prompt or [], **kw)  # type: ignore[arg-type]
    emitted, i = "", 0
    for size in chunks or [1] * len(ids):
        emitted += detok.append(ids[i : i + size])
        i += size
    return detok, emitted + detok.flush()


# --- Tokenizer -----------------------------------------------------------------------------


def test_special_ids_come_from_the_configs(tok: Tokenizer) -> None:
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids) == (0, 1, [1, 2])
    assert 256 + 3 < tok.vocab_size <= 420  # bytes + specials + some merges


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == BOS + text


def test_decode_skips_eos_and_ids_past_the_vocabulary(tok: Tokenizer) -> None:
    ids = tok.encode("héllo", add_special_tokens=False)
    assert tok.decode([*ids, tok.eos_token_id, tok.vocab_size + 3]) == "héllo"
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=False) == "héllo" + EOS


def test_missing_tokenizer_error_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")


def test_falls_back_to_auto_tokenizer_without_tokenizer_json(tmp_path: Path) -> None:
    _raw_tokenizer().model.save(str(tmp_path))  # vocab.json + merges.txt only
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GPT2Tokenizer",
                "bos_token": BOS,
                "eos_token": EOS,
                "add_bos_token": True,
            }
        )
    )
    tok = load_tokenizer(tmp_path)
    ids = tok.encode(TEXTS[0])
    assert ids[0] == tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.decode([*ids, 1]) == TEXTS[0]


# --- IncrementalDetokenizer ----------------------------------------------------------------


def test_incremental_text_equals_full_decode_at_every_step(tok: Tokenizer) -> None:
    """Complete characters appear at once; a split one is held back, never shown as U+FFFD."""
    held_back = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, [])
        emitted = ""
        for k in range(len(ids)):
            emitted += detok.append([ids[k]])
            full = tok.decode(ids[: k + 1])
            assert "\ufffd" not in detok.text
            assert emitted == detok.text and full.startswith(detok.text)
            if full.endswith("\ufffd"):
                held_back += 1
            else:
                assert detok.text == full
        assert detok.text == text and detok.token_ids == ids
    assert held_back > 0, "the texts should split some characters over several tokens"


def test_prompt_context_and_eos(tok: Tokenizer) -> None:
    prompt = tok.encode("the quick")
    out = tok.encode(" brown 日本語", add_special_tokens=False) + [tok.eos_token_id]
    detok, emitted = stream(tok, out, prompt=prompt)
    assert emitted == detok.text == " brown 日本語"
    detok, _ = stream(tok, out, prompt=prompt, skip_special_tokens=False)
    assert detok.text == " brown 日本語 " + EOS  # spaces_between_special_tokens (default)
    detok, _ = stream(
        tok, out, prompt=prompt, skip_special_tokens=False, spaces_between_special_tokens=False
    )
    assert detok.text == " brown 日本語" + EOS


def test_a_stop_string_before_min_tokens_does_not_stop(tok: Tokenizer) -> None:
    ids = tok.encode("ab ab ab ab", add_special_tokens=False)
    first_ab = next(k for k in range(len(ids)) if "ab" in tok.decode(ids[: k + 1]))
    detok, _ = stream(tok, ids, stop=["ab"], min_tokens=first_ab + 2)
    assert detok.stop_hit == "ab" and len(detok.token_ids) > first_ab + 1
    detok, _ = stream(tok, ids, stop=["ab"])
    assert len(detok.token_ids) == first_ab + 1


def test_stop_string_spanning_tokens_is_cut(tok: Tokenizer) -> None:
    text, stop = "the quick brown fox jumps", "k bro"
    ids = tok.encode(text, add_special_tokens=False)
    assert all(stop not in tok.decode([i]) for i in ids), "the stop string must span tokens"
    detok, emitted = stream(tok, ids, stop=[stop])
    assert detok.stop_hit == stop and emitted == detok.text == "the quic"
    assert detok.append(ids[:1]) == ""  # nothing after a stop
    detok, emitted = stream(tok, ids, stop=[stop], include_stop_str_in_output=True)
    assert detok.stop_hit == stop and emitted == detok.text == "the quick bro"


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    ids = tok.encode("héllo wörld 日本語 🙂", add_special_tokens=False)
    detok, emitted = stream(tok, ids, [len(ids)], stop=["🙂", "wör", "llo"])
    assert detok.stop_hit == "llo" and emitted == "hé"


def test_text_that_may_start_a_stop_string_is_held_back(tok: Tokenizer) -> None:
    """Without a match, append lags by (longest stop - 1) chars; flush releases them."""
    ids = tok.encode("the lazy dog", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["dogs", "zz"])
    emitted = "".join(detok.append([i]) for i in ids)
    assert detok.stop_hit is None and detok.text == "the lazy dog"
    assert emitted == "the lazy " and emitted + detok.flush() == detok.text


# Text, not special tokens: "<|eos|>" encodes to the EOS id, which decoding skips (as
# vLLM's skip_special_tokens), so it would not come back as text (hypothesis found it).
unicode_text = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=40
).filter(lambda t: not any(special in t for special in (BOS, EOS, EOT)))


@settings(max_examples=150, deadline=None)
@given(text=unicode_text, data=st.data())
def test_incremental_equals_full_decode_for_random_unicode(
    tok: Tokenizer, text: str, data: st.DataObject
) -> None:
    """For any valid text and any chunking of its tokens, the stream rebuilds the text."""
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    detok, emitted = stream(tok, ids, chunks)
    assert emitted == detok.text == text


@settings(max_examples=150, deadline=None)
@given(text=unicode_text.filter(bool), data=st.data())
def test_stream_stops_at_first_occurrence_of_random_stop_string(
    tok: Tokenizer, text: str, data: st.DataObject
) -> None:
    """A stop string cut from the text ends the stream right before its first occurrence."""
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : data.draw(st.integers(start + 1, len(text)))]
    ids = tok.encode(text, add_special_tokens=False)
    detok, emitted = stream(tok, ids, stop=[stop])
    assert detok.stop_hit == stop
    assert emitted == detok.text == text[: text.find(stop)]
    assert "\ufffd" not in emitted
