"""The model a server serves, whichever executor runs it: the real engine (`LLM`'s
EngineCore over the torch executor) or its simulated twin (sim/twin.py).

Both give the server the same things: an EngineCore whose clock is the wall clock, a
step to call in the engine thread, the `InputProcessor` that tokenizes and builds
requests, and the chat template. The twin reads the checkpoint's tokenizer and chat
template where MODEL is a checkpoint (or `--tokenizer DIR` names one); a preset has
neither, so it takes token-id prompts and answers tokens with empty text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.entrypoints.input_processor import InputProcessor, maybe_tokenizer
from deepinfer.entrypoints.openai.chat_template import (
    ChatTemplate,
    find_chat_template,
    special_tokens,
)
from deepinfer.request import Request


@dataclass
class ServedModel:
    """What the server needs of a model."""

    name: str  # what /v1/models lists and requests name
    engine: EngineCore
    processor: InputProcessor
    step: Callable[[], list[Request]]  # one engine step (EngineCore.step or a paced one)
    shutdown: Callable[[], None]
    chat_template: ChatTemplate | None = None  # None: no chat API
    simulated: bool = False  # the twin: random tokens, no logprobs
    meta: dict[str, Any] = field(default_factory=dict)  # said at start-up

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


def real_model(
    model: str,
    engine: EngineConfig,
    *,
    name: str | None = None,
    chat_template: str | None = None,
    **llm_kwargs: Any,
) -> ServedModel:
    """`model` on the torch executor, loaded as `LLM` loads it (llm_kwargs: dtype,
    device, load_format, revision, trust_remote_code, enforce_eager, step_log)."""
    from deepinfer.entrypoints.llm import LLM

    if engine.data_parallel_size > 1:
        raise ValueError(
            f"data_parallel_size={engine.data_parallel_size}: the server runs one engine "
            "(LLM and `deepinfer generate` launch data-parallel ranks)"
        )
    config = {f: getattr(engine, f) for f in engine.__dataclass_fields__}
    llm = LLM(model, **llm_kwargs, **config)
    core = llm.engine
    assert isinstance(core, EngineCore)  # (one rank)
    core.record_steps = False  # a server runs for days: its steps are not kept
    model_dir = llm.executor.model_dir
    return ServedModel(
        name=name or model,
        engine=core,
        processor=llm.processor,
        step=core.step,
        shutdown=llm.shutdown,
        chat_template=_template(model_dir, chat_template, llm.tokenizer),
        meta={"executor": "torch", "startup_s": round(llm.startup_seconds, 1)},
    )


def simulated_model(
    model: str,
    engine: EngineConfig,
    *,
    name: str | None = None,
    chat_template: str | None = None,
    tokenizer: str | None = None,
    hardware: str = "h200",
    cost_model: str | None = None,
    profile: str | None = None,
    acceptance_rate: float | str = 0.7,
) -> ServedModel:
    """The simulated twin of `model` (a preset, a config.json or a checkpoint directory,
    or the demo model) on `hardware`, priced by `cost_model` (see sim/twin.py)."""
    from deepinfer.model_config import load_model_config
    from sim.twin import twin_engine

    model_dir = checkpoint_dir(model)
    spec = load_model_config(model_dir if model_dir is not None else model)
    tok_dir = Path(tokenizer) if tokenizer is not None else model_dir
    tok = maybe_tokenizer(tok_dir) if tok_dir is not None else None
    if tokenizer is not None and tok is None:
        raise ValueError(f"--tokenizer {tokenizer}: no tokenizer found there")
    excluded: set[int] = set(tok.special_ids) if tok is not None else set()
    eos = tok.eos_token_ids if tok is not None else spec.eos_token_id
    excluded.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    core, pacer, meta = twin_engine(
        engine,
        spec,
        hardware,
        cost_model,
        profile=profile,
        acceptance_rate=acceptance_rate,
        excluded_tokens=excluded,
    )
    processor = InputProcessor(tok, eos, spec.vocab_size, tok_dir or model)
    return ServedModel(
        name=name or model,
        engine=core,
        processor=processor,
        step=lambda: pacer.step(core),
        shutdown=lambda: None,
        chat_template=_template(tok_dir, chat_template, tok),
        simulated=True,
        meta={"executor": "sim", **meta},
    )


def checkpoint_dir(model: str) -> Path | None:
    """The directory holding `model`'s config.json (and maybe its tokenizer), or None
    for a preset."""
    from deepinfer.model_config import known_models
    from executors.demo import DEMO_MODEL_DIR, DEMO_MODEL_NAME

    if model == DEMO_MODEL_NAME:
        return DEMO_MODEL_DIR
    if model.lower() in known_models():
        return None
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        return path.parent
    raise ValueError(
        f"model {model!r}: the simulated server takes a preset ({', '.join(known_models())}), "
        "a config.json, a checkpoint directory or deepinfer-demo"
    )


def _template(model_dir: Any, given: str | None, tokenizer: Any) -> ChatTemplate | None:
    text = find_chat_template(model_dir, given)
    if text is None:
        return None
    if tokenizer is None:
        raise ValueError("--chat-template: the model has no tokenizer to encode the chat with")
    return ChatTemplate(text, special_tokens(model_dir))
