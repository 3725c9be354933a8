"""The OpenAI API's response bodies, built from the engine's `Delta`s.

Two shapes: `/v1/completions` (object `text_completion`, a choice's `text`, logprobs as
`tokens` / `token_logprobs` / `top_logprobs` / `text_offset`) and
`/v1/chat/completions` (`chat.completion[.chunk]`, a choice's `message` or `delta`,
logprobs as `content: [{token, logprob, bytes, top_logprobs}]`). Each streamed chunk
carries one delta; a whole response gathers every delta of a choice. A choice's index
is prompt * n + its index among the prompt's n completions, as the API numbers them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from deepinfer.entrypoints.openai.async_engine import Delta
from deepinfer.outputs import TokenLogprob


@dataclass
class Choice:
    """One completion gathered from its deltas."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprob_rows: list[list[TokenLogprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ResponseShape:
    """The JSON of one endpoint's responses for one request."""

    def __init__(
        self, chat: bool, request_id: str, model: str, n: int, tokenizer: Any, logprobs: bool
    ) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.n = n
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self._logprobs = logprobs
        self._started: set[int] = set()  # chat choices that sent their role
        self._offsets: dict[int, int] = {}  # completions: text offset per choice

    def index(self, d: Delta) -> int:
        return d.prompt * self.n + d.index

    # ---- streaming -------------------------------------------------------------------

    def chunk(self, d: Delta) -> dict[str, Any] | None:
        """The chunk of one delta; None when it adds nothing (a character not complete).
        Without a tokenizer (a preset's random weights) there is no text: each delta of
        tokens is a chunk of empty text, so a client still sees every token's time."""
        new_tokens = self._tokenizer is None and d.token_ids
        if not d.text and d.finish_reason is None and not d.logprobs and not new_tokens:
            return None
        i = self.index(d)
        choice: dict[str, Any] = {"index": i}
        if self.chat:
            delta: dict[str, Any] = {"content": d.text}
            if i not in self._started:
                self._started.add(i)
                delta = {"role": "assistant", **delta}
            choice["delta"] = delta
        else:
            choice["text"] = d.text
        choice["logprobs"] = self._logprob_block(d.logprobs or [], i) if self._logprobs else None
        choice["finish_reason"] = d.finish_reason
        if d.finish_reason is not None:
            choice["stop_reason"] = d.stop_reason
        return self._envelope([choice])

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return self._envelope([], usage=usage)

    # ---- whole responses -------------------------------------------------------------

    def response(self, choices: dict[int, Choice], usage: dict[str, int]) -> dict[str, Any]:
        out = []
        for i in sorted(choices):
            c = choices[i]
            text = "".join(c.text)
            body: dict[str, Any] = {"index": i}
            if self.chat:
                body["message"] = {"role": "assistant", "content": text}
            else:
                body["text"] = text
            body["logprobs"] = self._logprob_block(c.logprob_rows, i) if self._logprobs else None
            body["finish_reason"] = c.finish_reason
            body["stop_reason"] = c.stop_reason
            out.append(body)
        return self._envelope(out, usage=usage, whole=True)

    def _envelope(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, int] | None = None,
        whole: bool = False,
    ) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        if self.chat and not whole:
            kind += ".chunk"
        body: dict[str, Any] = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return body

    def _logprob_block(self, rows: list[list[TokenLogprob]], i: int) -> dict[str, Any]:
        decode = self._token_text
        if self.chat:
            return {
                "content": [
                    {
                        "token": decode(row[0].token_id),
                        "logprob": row[0].logprob,
                        "bytes": list(decode(row[0].token_id).encode()),
                        "top_logprobs": [
                            {
                                "token": decode(t.token_id),
                                "logprob": t.logprob,
                                "bytes": list(decode(t.token_id).encode()),
                            }
                            for t in row[1:]
                        ],
                    }
                    for row in rows
                ]
            }
        tokens = [decode(row[0].token_id) for row in rows]
        offsets = []
        at = self._offsets.get(i, 0)
        for t in tokens:
            offsets.append(at)
            at += len(t)
        self._offsets[i] = at
        return {
            "tokens": tokens,
            "token_logprobs": [row[0].logprob for row in rows],
            "top_logprobs": [{decode(t.token_id): t.logprob for t in row} for row in rows],
            "text_offset": offsets,
        }

    def _token_text(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return str(self._tokenizer.decode([token_id], skip_special_tokens=False))


def gather(choices: dict[int, Choice], shape: ResponseShape, deltas: list[Delta]) -> None:
    """Add one step's deltas to the choices of a whole response."""
    for d in deltas:
        c = choices.setdefault(shape.index(d), Choice())
        c.text.append(d.text)
        c.num_tokens += len(d.token_ids)
        if d.logprobs:
            c.logprob_rows.extend(d.logprobs)
        if d.finish_reason is not None:
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
