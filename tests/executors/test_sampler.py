"""The sampler: each filter against hand-computed values, then the batched entry point."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from deepinfer.sampling_params import SamplingParams
from executors.logits_processors import (
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k,
    apply_top_p,
)
from executors.sampler import SamplingState, greedy, random_sample, sample_tokens

NEG_INF = float("-inf")


def state(prompt: list[int] | None = None, eos: int | None = None, **kw: object) -> SamplingState:
    return SamplingState(SamplingParams(**kw), list(prompt or [0]), eos_token_id=eos)


def rows(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# --- the pure functions --------------------------------------------------------------------


def test_penalties_match_hand_computed_values() -> None:
    """Repetition covers prompt and output; frequency and presence count output only."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    out = apply_penalties(
        logits, [[0]], [[1, 1, 2]], presence=rows(0.25), frequency=rows(0.5), repetition=rows(2.0)
    )
    # 0: prompt only -> 2 / 2;  1: -1 * 2 - 2 * 0.5 - 0.25;  2: 0.5 / 2 - 0.5 - 0.25;  3: unseen
    assert out.tolist() == [[1.0, -3.25, -0.5, 3.0]]


def test_default_penalties_leave_logits_bit_identical() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    out = apply_penalties(
        logits,
        [[1, 2], [3], []],
        [[4, 4], [], [5]],
        presence=rows(0, 0, 0),
        frequency=rows(0, 0, 0),
        repetition=rows(1, 1, 1),
    )
    assert torch.equal(out, logits)


def test_temperature_divides_each_row() -> None:
    logits = torch.tensor([[2.0, 4.0], [2.0, 4.0]])
    assert apply_temperature(logits, rows(2.0, 0.5)).tolist() == [[1.0, 2.0], [4.0, 8.0]]


def test_top_k_keeps_k_largest_and_zero_disables() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    out = apply_top_k(logits, torch.tensor([2, 0]))
    assert out[0].tolist() == [NEG_INF, 4.0, 3.0, NEG_INF]
    assert torch.equal(out[1], logits[1])


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3)
    out = apply_top_p(probs.log(), rows(0.7, 1e-6, 1.0))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(out[1]).tolist() == [True, False, False, False]  # tiny p: argmax only
    assert torch.equal(out[2], probs[2].log())


def test_min_p_drops_tokens_below_fraction_of_top_probability() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs.log(), rows(0.2, 0.0))  # threshold 0.1
    assert torch.isfinite(out[0]).tolist() == [True, True, True, False]
    assert torch.equal(out[1], probs[1].log())


def test_random_sample_with_one_hot_probs_picks_that_token() -> None:
    probs = torch.zeros(3, 10)
    probs[torch.arange(3), torch.tensor([7, 0, 9])] = 1.0
    gens = [None, torch.Generator().manual_seed(1), None]
    assert random_sample(probs, gens).tolist() == [7, 0, 9]


# --- sample_tokens -------------------------------------------------------------------------


def test_greedy_equals_argmax_and_consumes_no_randomness() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(5)
    before = gen.get_state()
    out = sample_tokens(logits, [state(temperature=0.0) for _ in range(6)], gen)
    assert out.token_ids == greedy(logits).tolist() == logits.argmax(-1).tolist()
    assert torch.equal(gen.get_state(), before)
    assert out.logprobs is None


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        out = sample_tokens(logits, [state(temperature=1.5, top_k=1) for _ in range(8)], gen)
        assert out.token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_always_picks_the_most_likely_token() -> None:
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    states = [state(temperature=1.0, top_p=1e-6, seq_seed=i) for i in range(8)]
    assert sample_tokens(logits, states).token_ids == logits.argmax(-1).tolist()


def test_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    st = state(temperature=0.0, repetition_penalty=2.0)
    st.output_token_ids = [0]
    assert sample_tokens(logits, [st]).token_ids == [1]  # 3 / 2 < 2


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])  # eos=1 is the favourite, stop token 2 next
    st = state(eos=1, temperature=0.0, min_tokens=3, stop_token_ids=[2])
    picks = []
    for _ in range(4):
        tok = sample_tokens(logits, [st]).token_ids[0]
        picks.append(tok)
        st.output_token_ids.append(tok)
    assert picks == [3, 3, 3, 1]


def test_min_tokens_with_ignore_eos_keeps_eos_allowed() -> None:
    st = state(eos=1, temperature=0.0, min_tokens=3, ignore_eos=True)
    assert sample_tokens(torch.tensor([[0.0, 5.0, 4.0]]), [st]).token_ids == [1]


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    states = [
        state(temperature=0.7, top_k=5, presence_penalty=1.0, logprobs=3, seq_seed=1),
        state(temperature=0.0, logprobs=0),
        state(temperature=1.0),
    ]
    states[0].output_token_ids = [int(logits[0].argmax())]
    out = sample_tokens(logits, states)
    raw = logits.log_softmax(-1)
    assert out.logprobs is not None
    for i in (0, 1):
        chosen = out.logprobs[i][0]
        assert chosen.token_id == out.token_ids[i]
        assert math.isclose(chosen.logprob, raw[i, chosen.token_id].item(), abs_tol=1e-6)
        assert chosen.rank == int((raw[i] >= raw[i, chosen.token_id]).sum())
    top = out.logprobs[0][1:]
    assert [t.token_id for t in top] == raw[0].topk(3).indices.tolist()
    assert [t.rank for t in top] == [1, 2, 3]
    assert len(out.logprobs[1]) == 1 and out.logprobs[1][0].rank == 1  # greedy: top token
    assert out.logprobs[2] == []


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of observed counts to a distribution."""
    counts = counts.double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


def _step_logits(step: int, vocab: int = 50) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step))


def _run_seeded(
    seq_seed: int, position: int, others: list[SamplingParams], steps: int
) -> list[int]:
    """Sample `steps` tokens for one seeded request placed among `others`."""
    gen = torch.Generator().manual_seed(position * 7 + len(others))
    target = SamplingState(
        SamplingParams(temperature=0.9, top_p=0.95, seq_seed=seq_seed, repetition_penalty=1.1),
        [3, 4, 5],
    )
    other_states = [SamplingState(p, [1, 2]) for p in others]
    for _ in range(steps):
        batch = other_states[:position] + [target] + other_states[position:]
        logits = torch.randn(len(batch), 50, generator=gen)
        logits[position] = _step_logits(len(target.output_token_ids))
        out = sample_tokens(logits, batch, gen)
        for st, tok in zip(batch, out.token_ids):
            st.output_token_ids.append(tok)
    return target.output_token_ids


def test_seeded_request_is_independent_of_batch_composition_and_position() -> None:
    """Same seq_seed, same logits row => same tokens, whatever else is in the batch."""
    others = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_k=3, min_p=0.1, seq_seed=99),
        SamplingParams(temperature=1.2, top_p=0.5, frequency_penalty=1.0, logprobs=2),
    ]
    alone = _run_seeded(1234, 0, [], steps=8)
    torch.manual_seed(0)  # the global RNG must not matter either
    for position, batch in [(0, others), (2, others), (4, others), (1, others[:2])]:
        assert _run_seeded(1234, position, batch, steps=8) == alone
    assert _run_seeded(4321, 0, [], steps=8) != alone


def test_sampling_frequencies_follow_softmax() -> None:
    """Unseeded and seeded paths both draw from softmax(logits / temperature)."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0])
    expected = (logits / 0.8).softmax(-1)
    n = 20000
    batch = logits.expand(n, -1).clone()
    unseeded = sample_tokens(
        batch, [state(temperature=0.8) for _ in range(n)], torch.Generator().manual_seed(0)
    ).token_ids
    seeded = [
        sample_tokens(logits[None], [state(temperature=0.8, seq_seed=s)]).token_ids[0]
        for s in range(4000)
    ]
    for draws in (unseeded, seeded):
        assert _chi2_pvalue(torch.bincount(torch.tensor(draws), minlength=8), expected) > 1e-4


def test_top_k_sampling_renormalises_over_the_kept_tokens() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 3.0, 2.0])
    n = 20000
    draws = sample_tokens(
        logits.expand(n, -1).clone(),
        [state(temperature=1.0, top_k=3) for _ in range(n)],
        torch.Generator().manual_seed(1),
    ).token_ids
    counts = torch.bincount(torch.tensor(draws), minlength=6).double()
    assert counts[[1, 2, 3]].sum() == 0
    kept = torch.tensor([0, 4, 5])
    assert _chi2_pvalue(counts[kept], logits[kept].softmax(-1)) > 1e-4


@pytest.mark.gpu
def test_seeded_sampling_on_cuda_is_batch_invariant() -> None:
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)).cuda()
    states = [state(temperature=1.0, seq_seed=7)] + [state(temperature=1.0) for _ in range(3)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    batched = sample_tokens(logits, states, gen).token_ids[0]
    alone = sample_tokens(logits[:1], [state(temperature=1.0, seq_seed=7)]).token_ids[0]
    assert batched == alone
