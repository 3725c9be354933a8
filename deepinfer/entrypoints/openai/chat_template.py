"""Chat messages to a prompt, by the checkpoint's chat template (Jinja), as transformers'
`apply_chat_template` renders it.

The template is `--chat-template` (a file, or the template text itself), else the
checkpoint's `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (a
string, or a list of named templates: the one named "default"). A checkpoint with none
has no chat API: /v1/chat/completions answers 400 saying so. Templates run in Jinja's
sandbox, with transformers' globals (`raise_exception`, `bos_token`, `eos_token`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def find_chat_template(model_dir: str | Path | None, given: str | None = None) -> str | None:
    """The template text: `given` (a path or the text), else the checkpoint's, else None."""
    if given is not None:
        path = Path(given).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8")
        if "{" not in given:
            raise ValueError(f"--chat-template {given!r}: no such file, nor a Jinja template")
        return given
    if model_dir is None:
        return None
    root = Path(model_dir)
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    config = root / "tokenizer_config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(value, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled template; `render(messages)` is the prompt text."""

    def __init__(self, text: str, special_tokens: dict[str, str | None]) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(text)
        except TemplateError as e:
            raise ValueError(f"chat template: {e}") from None
        self._special = special_tokens

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt; ValueError with the template's own message when it refuses them."""
        from jinja2 import TemplateError

        try:
            text = self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self._special
            )
        except TemplateError as e:
            raise ValueError(f"messages: the chat template refused them: {e}") from None
        if continue_final_message:  # the reply continues the last message's text
            last = messages[-1]["content"]
            cut = text.rfind(last) if last else -1
            if cut < 0:
                raise ValueError("continue_final_message: the template does not end with it")
            text = text[: cut + len(last)]
        return text


def special_tokens(model_dir: str | Path | None) -> dict[str, str | None]:
    """bos_token and eos_token as tokenizer_config.json spells them (templates use them)."""
    out: dict[str, str | None] = {"bos_token": None, "eos_token": None}
    config = Path(model_dir) / "tokenizer_config.json" if model_dir is not None else None
    if config is None or not config.is_file():
        return out
    raw = json.loads(config.read_text(encoding="utf-8"))
    for key in out:
        value = raw.get(key)
        out[key] = value.get("content") if isinstance(value, dict) else value
    return out


def _raise(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)
