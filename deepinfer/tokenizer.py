"""Load a checkpoint's tokenizer behind one small interface.

`tokenizer.json` is read with the `tokenizers` library; the special tokens come
from `tokenizer_config.json` (bos/eos, `add_bos_token`) and, for the ids of
extra end tokens, `generation_config.json` / `config.json`. A checkpoint
without `tokenizer.json` (e.g. a tiktoken-based one) goes through transformers'
AutoTokenizer instead. Streaming detokenization lives in `detokenizer.py`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from deepinfer.detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "load_tokenizer"]


class _Backend(Protocol):
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    def vocab_size(self) -> int: ...
    def special_ids(self) -> set[int]: ...
    def vocab(self) -> dict[str, int]: ...
    def added_ids(self) -> set[int]: ...
    def serialized(self) -> str | None: ...
    def hf_tokenizer(self) -> Any: ...


class _FastBackend:
    """A `tokenizers.Tokenizer` read from tokenizer.json."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def special_ids(self) -> set[int]:
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def vocab(self) -> dict[str, int]:
        return dict(self._tok.get_vocab(with_added_tokens=True))

    def added_ids(self) -> set[int]:
        return set(self._tok.get_added_tokens_decoder())

    def serialized(self) -> str | None:
        return str(self._tok.to_str())

    def hf_tokenizer(self) -> Any:
        return None


class _HFBackend:
    """transformers' AutoTokenizer, for checkpoints without tokenizer.json."""

    def __init__(self, model_dir: Path, trust_remote_code: bool) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(
            str(model_dir), trust_remote_code=trust_remote_code
        )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        i = self._tok.convert_tokens_to_ids(token)
        return i if isinstance(i, int) and i != self._tok.unk_token_id else None

    def vocab_size(self) -> int:
        return len(self._tok)

    def special_ids(self) -> set[int]:
        return set(self._tok.all_special_ids)

    def vocab(self) -> dict[str, int]:
        return dict(self._tok.get_vocab())

    def added_ids(self) -> set[int]:
        return set(getattr(self._tok, "added_tokens_decoder", {}))

    def serialized(self) -> str | None:
        return None

    def hf_tokenizer(self) -> Any:
        return self._tok


class Tokenizer:
    """encode / decode plus the special-token ids the engine needs.

    `vocab_size` counts the tokenizer's tokens (added ones included); a model's
    embedding is often padded larger, and decode ignores ids past the end.
    `eos_token_ids` lists the tokenizer's EOS first, then any other end ids that
    generation_config.json names (the engine may treat those as stop tokens).
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        eos_token_ids: list[int] | None = None,
        add_bos: bool = False,
        name: str = "",
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.eos_token_ids = eos_token_ids or ([] if eos_token_id is None else [eos_token_id])
        self.add_bos = add_bos
        self.name = name
        self.vocab_size = backend.vocab_size()
        ends = {t for t in (bos_token_id, eos_token_id) if t is not None}
        self.special_ids: frozenset[int] = frozenset(backend.special_ids() | ends)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with special tokens, BOS leads when the config asks."""
        ids = self._backend.encode(text, add_special_tokens)
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included. Strings are as the vocabulary stores
        them (byte-level BPE: 'Ġthe'); added tokens are plain text (`added_token_ids`)."""
        return self._backend.vocab()

    def added_token_ids(self) -> set[int]:
        return self._backend.added_ids()

    def serialized(self) -> str | None:
        """The tokenizer.json text (its decoder says how tokens encode bytes); None when
        transformers' AutoTokenizer loaded it (`hf_tokenizer` is then that object)."""
        return self._backend.serialized()

    @property
    def hf_tokenizer(self) -> Any:
        return self._backend.hf_tokenizer()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [i for i in ids if 0 <= i < self.vocab_size]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._backend.decode(ids, skip_special_tokens)

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token_id}, eos={self.eos_token_id})"
        )


def load_tokenizer(model_dir: str | Path, trust_remote_code: bool = False) -> Tokenizer:
    """The tokenizer of a local checkpoint directory.

    Raises FileNotFoundError naming the directory when it holds no tokenizer.
    `trust_remote_code` is passed to AutoTokenizer (custom tokenizer classes).
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer: {str(root)!r} is not a directory")
    tok_cfg = _read_json(root / "tokenizer_config.json")
    gen_cfg = _read_json(root / "generation_config.json")
    model_cfg = _read_json(root / "config.json")

    backend: _Backend
    if (root / "tokenizer.json").is_file():
        backend = _FastBackend(root / "tokenizer.json")
    else:
        try:
            backend = _HFBackend(root, trust_remote_code)
        except Exception as e:  # transformers raises many kinds here
            raise FileNotFoundError(
                f"no tokenizer found in {str(root)!r}: expected tokenizer.json, or files "
                f"transformers' AutoTokenizer can load ({type(e).__name__}: {e})"
            ) from e

    bos = _token_id(backend, tok_cfg.get("bos_token"))
    if bos is None:
        bos = _first_id(gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id")))
    end_ids = _id_list(gen_cfg.get("eos_token_id", model_cfg.get("eos_token_id")))
    eos = _token_id(backend, tok_cfg.get("eos_token"))
    if eos is None and end_ids:
        eos = end_ids[0]
    eos_ids = ([eos] if eos is not None else []) + [t for t in end_ids if t != eos]
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_id=eos,
        eos_token_ids=eos_ids,
        add_bos=bool(tok_cfg.get("add_bos_token", False)),
        name=str(root),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_id(backend: _Backend, token: Any) -> int | None:
    """Id of a special token given as a string or as an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) and token else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _first_id(value: Any) -> int | None:
    ids = _id_list(value)
    return ids[0] if ids else None
