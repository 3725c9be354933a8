"""Streaming detokenization with stop strings, one object per request.

Decoding token by token and concatenating is wrong twice over: a multi-byte
UTF-8 character may be split over several tokens (each alone decodes to
U+FFFD), and some decoders treat a sequence's first token specially (leading
space). So, as vLLM does, every step decodes a short window of recent tokens
twice: `ids[prefix:read]` (text already emitted, as context) and `ids[prefix:]`;
what the second adds is the new text. When it ends in U+FFFD the character is
incomplete: nothing is emitted and the window grows until it completes.

Stop strings may span tokens: each step searches the newly decoded text plus
the longest stop string's length of what came before. `append` returns only
text that is final: without `include_stop_str_in_output`, the last
(longest stop - 1) characters are held back, since they may start a stop string.
"""

from __future__ import annotations

from typing import Protocol

# Prompt tokens kept as context for decoding the first output tokens.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output token ids into text as they arrive.

    After each `append`: `text` is the whole output text so far (cut before the
    stop string once one is hit, or after it with include_stop_str_in_output),
    `stop_hit` the stop string found or None, and `token_ids` the output ids.
    The concatenated `append` results plus a final `flush()` equal `text`.
    Bytes of a character left incomplete when the request ends are dropped.
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        spaces_between_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Special tokens kept in the text are joined to their neighbours by a space
        # (vLLM's spaces_between_special_tokens), when the tokenizer says which they are.
        specials = getattr(tokenizer, "special_ids", None)
        self._specials: frozenset[int] = (
            frozenset(specials)
            if specials and not skip_special_tokens and spaces_between_special_tokens
            else frozenset()
        )
        self._min_tokens = min_tokens  # a stop string counts from this many tokens on
        self._stop = [s for s in (stop or []) if s]
        self._include_stop = include_stop_str_in_output
        self._max_stop = max((len(s) for s in self._stop), default=0)
        # Held back from `append`: a suffix that could still grow into a stop string.
        self._hold = 0 if include_stop_str_in_output else max(self._max_stop - 1, 0)
        # Decoding window over self._ids: [prefix, read) is already emitted context.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self._decoded = ""  # every character decoded so far, stop string not cut
        self._emitted = 0  # characters of `text` returned by append / flush
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_hit: str | None = None

    def append(self, token_ids: list[int]) -> str:
        """Add output tokens; return the text they make final (possibly "")."""
        if self.stop_hit is not None:
            return ""
        self.token_ids.extend(token_ids)
        self._ids.extend(token_ids)
        before = len(self._decoded)
        self._decoded += self._decode_new()
        if len(self._decoded) == before:
            return ""
        self.text = self._decoded
        if len(self.token_ids) >= self._min_tokens:
            self._find_stop(before)
        end = len(self.text) if self.stop_hit is not None else len(self.text) - self._hold
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def flush(self) -> str:
        """The text still held back; call once when the request finishes."""
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta

    def _decode_new(self) -> str:
        """Text the tokens past the read offset add, once it ends on a whole character."""
        window = self._ids[self._prefix :]
        seen = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(window)
        if len(full) <= len(seen) or full.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or a character still incomplete
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(seen) :]

    def _decode(self, ids: list[int]) -> str:
        if not self._specials or not any(i in self._specials for i in ids):
            return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
        parts: list[str] = []
        run: list[int] = []
        for i in ids:  # ordinary runs decode together; each special token stands alone
            if i in self._specials:
                if run:
                    parts.append(self._tokenizer.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(self._tokenizer.decode([i], skip_special_tokens=False))
            else:
                run.append(i)
        if run:
            parts.append(self._tokenizer.decode(run, skip_special_tokens=False))
        return " ".join(parts)

    def _find_stop(self, before: int) -> None:
        """Cut `text` at the earliest stop string that ends in the new text."""
        if not self._stop:
            return
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self._decoded.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return
        i, s = best
        self.stop_hit = s
        self.text = self._decoded[: i + len(s) if self._include_stop else i]
