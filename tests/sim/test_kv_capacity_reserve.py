"""The simulator's activation reserve follows the torch executor's memory profile: a
forward over the whole token budget, then the sampler over a step's logits (every
request and its drafts); the peak is the larger of the two."""

from __future__ import annotations

from deepinfer.model_config import load_model_config
from sim.kv_capacity import (
    FIXED_RESERVE_BYTES,
    SAMPLER_PEAK_BYTES_PER_LOGIT,
    default_activation_reserve_bytes,
)


def test_drafts_grow_the_sampler_rows_up_to_the_token_budget() -> None:
    m = load_model_config("moonlight-16b-a3b")
    plain = default_activation_reserve_bytes(m, 8192, 256, 0)
    spec = default_activation_reserve_bytes(m, 8192, 256, 3)
    assert spec == FIXED_RESERVE_BYTES + 1024 * m.vocab_size * SAMPLER_PEAK_BYTES_PER_LOGIT
    assert spec > plain
    # rows are capped by the budget: 256 x 6 > 1,024 tokens
    capped = default_activation_reserve_bytes(m, 1024, 256, 5)
    assert capped == FIXED_RESERVE_BYTES + 1024 * m.vocab_size * SAMPLER_PEAK_BYTES_PER_LOGIT


def test_the_forward_sets_the_peak_when_its_budget_outweighs_the_logits() -> None:
    m = load_model_config("moonlight-16b-a3b")
    small = default_activation_reserve_bytes(m, 65536, 1, 0)
    assert small > FIXED_RESERVE_BYTES + 1 * m.vocab_size * SAMPLER_PEAK_BYTES_PER_LOGIT
    assert small == default_activation_reserve_bytes(m, 65536, 2, 0)  # (the forward's max)
