"""xgrammar's view of a model's vocabulary, built from the checkpoint's own tokenizer.

Byte-level BPE vocabularies store each token as printable stand-ins for its bytes
('Ġthe'); xgrammar decodes them given the vocabulary type that tokenizer.json's decoder
declares. Added tokens are stored as plain text and special tokens are never
generated under a grammar, so both are fixed up here.
"""

from __future__ import annotations

from typing import Any

from deepinfer.tokenizer import Tokenizer


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_ids: list[int]) -> Any:
    """xgrammar's TokenizerInfo over the model's `vocab_size` ids.

    Special tokens (BOS, padding, ...) and ids past the tokenizer's end are given no text,
    so no grammar ever allows them; `stop_ids` are allowed where the grammar may end.
    Added tokens are stored as plain text: in a byte-level vocabulary they are re-encoded
    as byte-level strings, so xgrammar decodes them to their real bytes. A checkpoint
    without tokenizer.json (tiktoken or sentencepiece files, as Moonlight ships) goes
    through xgrammar's own reader of transformers' tokenizer.
    """
    import xgrammar as xgr

    stop = [t for t in stop_ids if 0 <= t < vocab_size] or None
    serialized = tokenizer.serialized()
    if serialized is None:  # xgrammar decodes it; its bytes kept, special tokens dropped
        base = xgr.TokenizerInfo.from_huggingface(tokenizer.hf_tokenizer, vocab_size=vocab_size)
        never = tokenizer.special_ids | set(base.special_token_ids)
        decoded = [b"" if i in never else t for i, t in enumerate(base.decoded_vocab)]
        return xgr.TokenizerInfo(
            decoded[:vocab_size], xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop
        )
    # tokenizer.json: its decoder says how tokens encode bytes
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(serialized)
    vocab_type, add_prefix_space = meta["vocab_type"], meta["add_prefix_space"]
    added, special = tokenizer.added_token_ids(), tokenizer.special_ids
    encoded = [""] * vocab_size  # "": xgrammar never allows the id
    for token, i in tokenizer.vocab().items():
        if i >= vocab_size or i in special:
            continue
        if i in added and vocab_type == xgr.VocabType.BYTE_LEVEL:
            token = "".join(_BYTE_TO_CHAR[b] for b in token.encode())
        encoded[i] = token
    return xgr.TokenizerInfo(
        encoded,
        vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stop,
        add_prefix_space=add_prefix_space,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_TO_CHAR = _bytes_to_unicode()
