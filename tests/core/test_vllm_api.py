"""The offline API's names follow vLLM's documented ones (no vLLM import needed): every
documented field is ours with the same default, or left out for a stated reason."""

from __future__ import annotations

import dataclasses

from deepinfer import SamplingParams
from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput

# vllm.SamplingParams (docs.vllm.ai, v0.8), public fields and their defaults.
VLLM_SAMPLING = {
    "n": 1, "best_of": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
    "seed": None, "stop": None, "stop_token_ids": None, "ignore_eos": False, "max_tokens": 16,
    "min_tokens": 0, "logprobs": None, "prompt_logprobs": None, "detokenize": True,
    "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "logits_processors": None, "include_stop_str_in_output": False,
    "truncate_prompt_tokens": None, "output_kind": "CUMULATIVE", "guided_decoding": None,
    "logit_bias": None, "allowed_token_ids": None, "extra_args": None, "bad_words": None,
}  # fmt: skip
LEFT_OUT = {
    "detokenize": "text is always produced when the model has a tokenizer",
    "logits_processors": "arbitrary Python callables per token would defeat the simulator",
    "truncate_prompt_tokens": "a prompt too long is rejected with both sizes, never cut",
    "output_kind": "generate returns whole outputs; there is no streaming API",
    "guided_decoding": "structured outputs are `so_args` (the reference engine's name)",
    "logit_bias": "not implemented; an unknown keyword is a TypeError, never ignored",
    "allowed_token_ids": "not implemented; an unknown keyword is a TypeError",
    "extra_args": "no extension point takes them",
    "bad_words": "not implemented; an unknown keyword is a TypeError",
}
# Same meaning, another default spelling: vLLM's -1 and empty lists.
EQUIVALENT_DEFAULTS = {"top_k": 0, "stop": [], "stop_token_ids": []}

VLLM_COMPLETION = [
    "index",
    "text",
    "token_ids",
    "cumulative_logprob",
    "logprobs",
    "finish_reason",
    "stop_reason",
]  # (lora_request: no LoRA here)
VLLM_REQUEST = [
    "request_id",
    "prompt",
    "prompt_token_ids",
    "prompt_logprobs",
    "outputs",
    "finished",
    "metrics",
    "num_cached_tokens",
]  # (lora, encoder fields: n/a)
VLLM_LOGPROB = ["logprob", "rank", "decoded_token"]


def _defaults(cls: type) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_every_vllm_sampling_field_is_ours_with_its_default_or_left_out_for_a_reason() -> None:
    ours = _defaults(SamplingParams)
    for name, default in VLLM_SAMPLING.items():
        if name in LEFT_OUT:
            assert name not in ours, f"{name} is implemented: take it out of LEFT_OUT"
            continue
        assert name in ours, f"vLLM's SamplingParams.{name} is missing"
        assert ours[name] == EQUIVALENT_DEFAULTS.get(name, default), name
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's spelling of "disabled" works


def test_an_unknown_sampling_option_is_an_error_naming_it() -> None:
    try:
        SamplingParams(logit_bias={1: 2.0})  # type: ignore[call-arg]
    except TypeError as e:
        assert "logit_bias" in str(e)
    else:
        raise AssertionError("an unknown option was accepted")


def test_output_classes_have_vllms_fields_in_vllms_order() -> None:
    for cls, names in (
        (CompletionOutput, VLLM_COMPLETION),
        (RequestOutput, VLLM_REQUEST),
        (Logprob, VLLM_LOGPROB),
    ):
        ours = [f.name for f in dataclasses.fields(cls)]
        assert [n for n in ours if n in names] == names, cls.__name__
