"""Draft verification (executors/spec_decode.py) on synthetic distributions: speculative
sampling leaves the output distribution exactly that of plain sampling."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from deepinfer.sampling_params import SamplingParams
from executors.sampler import SamplingState
from executors.spec_decode import VerifyRequest, verify, verify_on_device

TRIALS = 20_000


def dist(*values: float) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return (t / t.sum()).float()


# Target rows p_0 (first token), p_1 (after d_1), p_2 (bonus after d_1 d_2), and draft
# distributions q_1, q_2 far from them, so that many drafts are rejected. Token 5 has
# p_0 = 0 but q_1 > 0 (a draft the target never emits).
P = [dist(30, 25, 20, 15, 10, 0), dist(5, 10, 40, 5, 20, 20), dist(1, 2, 3, 4, 5, 6)]
Q = [dist(5, 5, 10, 30, 20, 30), dist(20, 30, 10, 10, 20, 10)]


def run_trials(
    p: list[torch.Tensor], q: list[torch.Tensor] | None, drafts: torch.Tensor, seed: int
) -> list[list[int]]:
    """One verify call over TRIALS requests with the same rows; drafts: [TRIALS, k]."""
    k = drafts.shape[1]
    logits = torch.stack(p[: k + 1]).log().repeat(TRIALS, 1)  # softmax at temperature 1 = p
    draft_probs = torch.stack(q[:k]) if q is not None else None
    params = SamplingParams(temperature=1.0)
    reqs = [
        VerifyRequest(i * (k + 1), drafts[i].tolist(), SamplingState(params, [0]), draft_probs)
        for i in range(TRIALS)
    ]
    return verify(logits, reqs, torch.Generator().manual_seed(seed)).tokens


def sample(q: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    return torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(seed))


def assert_follows(tokens: list[int], p: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(p)).double()
    support = p > 0
    assert counts[~support].sum() == 0, "a token the target never emits was output"
    expected = p[support].double() / p[support].double().sum() * counts.sum()
    result = chisquare(counts[support].numpy(), expected.numpy())
    assert result.pvalue > 1e-3, (counts.tolist(), expected.tolist(), result)


def test_speculative_sampling_keeps_each_positions_distribution() -> None:
    """Drafts d_j ~ q_j: the first token follows p_0; given d_1 was accepted (the output's
    first token is d_1), the second follows p_1; given both, the bonus follows p_2."""
    drafts = torch.stack([sample(Q[0], TRIALS, 1), sample(Q[1], TRIALS, 2)], dim=1)
    out = run_trials(P, Q, drafts, seed=3)
    assert_follows([t[0] for t in out], P[0])
    after_1 = [t[1] for t, d in zip(out, drafts.tolist()) if t[0] == d[0]]
    after_2 = [t[2] for t, d in zip(out, drafts.tolist()) if t[:2] == d]
    assert len(after_1) > 3000 and len(after_2) > 1000
    assert_follows(after_1, P[1])
    assert_follows(after_2, P[2])
    # The first draft is accepted with probability sum(min(p_0, q_1)) = 1 - TV(p_0, q_1).
    rate = sum(t[0] == d for t, d in zip(out, drafts[:, 0].tolist())) / TRIALS
    assert rate == pytest.approx(float(torch.minimum(P[0], Q[0]).sum()), abs=0.02)


def test_drafts_without_a_distribution_count_as_deterministic() -> None:
    """A proposer that keeps no q (q = one-hot on its draft) is verified losslessly too."""
    drafts = torch.full((TRIALS, 1), 2)
    out = run_trials(P, None, drafts, seed=4)
    assert_follows([t[0] for t in out], P[0])
    rate = sum(t[0] == 2 for t in out) / TRIALS
    assert rate == pytest.approx(float(P[0][2]), abs=0.02)


def test_greedy_accepts_the_longest_matching_prefix() -> None:
    logits = torch.tensor([[0.0, 5, 0], [5, 0, 0], [0, 0, 5]])  # argmax 1, then 0, then 2
    greedy = SamplingState(SamplingParams(temperature=0.0), [0])
    for drafts, expect in (([1, 0], [1, 0, 2]), ([1, 2], [1, 0]), ([0, 0], [1])):
        assert verify(logits, [VerifyRequest(0, drafts, greedy)], None).tokens == [expect]


def test_each_row_sees_the_drafts_before_it_in_its_history() -> None:
    """Penalties of row j count d_1..d_j as outputs: the verify step gives what plain
    decoding one token at a time gives."""
    logits = torch.tensor([[0.0, 1, 1.5, 1.2]]).repeat(3, 1)
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    state = SamplingState(params, [0])
    # Plain decoding: 2 (unpenalised), then 3 (2 penalised), then 1.
    assert verify(logits, [VerifyRequest(0, [2, 3], state)], None).tokens == [[2, 3, 1]]
    # min_tokens counts the drafts too: EOS (token 0) is allowed from row 1 on.
    eos_logits = torch.tensor([[9.0, 1, 5, 2]]).repeat(2, 1)
    state = SamplingState(SamplingParams(temperature=0.0, min_tokens=1), [0], eos_token_id=0)
    assert verify(eos_logits, [VerifyRequest(0, [2], state)], None).tokens == [[2, 0]]


def test_seeded_requests_do_not_depend_on_the_batch() -> None:
    """A seeded request's acceptance tests and samples come from its own generator."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    q = torch.softmax(torch.randn(2, 50), dim=-1)

    def seeded(outputs: list[int]) -> SamplingState:
        return SamplingState(SamplingParams(temperature=1.0, seq_seed=11), [0], list(outputs))

    def other() -> SamplingState:
        return SamplingState(SamplingParams(temperature=0.8), [0])

    drafts = [int(q[0].argmax()), int(q[1].argmax())]
    alone = verify(logits, [VerifyRequest(0, drafts, seeded([4]), q)], None).tokens[0]
    noise = torch.randn(5, 50)
    batch = torch.cat([noise[:2], logits, noise[2:]])
    reqs = [
        VerifyRequest(0, [7], other()),
        VerifyRequest(2, drafts, seeded([4]), q),
        VerifyRequest(5, [1, 2], other()),
    ]
    for g in (None, torch.Generator().manual_seed(5)):
        assert verify(batch, reqs, g).tokens[1] == alone
    # A different output index draws differently (not one fixed stream for every step).
    outs = {tuple(verify(logits, [VerifyRequest(0, drafts, seeded([4] * n), q)], None).tokens[0])
            for n in range(12)}  # fmt: skip
    assert len(outs) > 1


def _on_device(
    p: list[torch.Tensor], drafts: list[int], n: int, params: SamplingParams, seed: int
) -> tuple[list[list[int]], list[int]]:
    """verify_on_device over n requests with the same rows p[: k + 1] and drafts: each
    request's output tokens (accepted drafts, then the sampled one) and accepted count."""
    k = len(drafts)
    logits = torch.stack(p[: k + 1]).log().repeat(n, 1)
    row_drafts = torch.tensor([*drafts, 0]).repeat(n)  # the token after each row
    states = [SamplingState(params, [0]) for _ in range(n)]
    out = verify_on_device(logits, states, [k] * n, row_drafts, torch.Generator().manual_seed(seed))
    accepted = out.accepted.tolist()
    return [t[: a + 1] for t, a in zip(out.tokens.tolist(), accepted)], accepted


def test_device_verification_keeps_each_positions_distribution() -> None:
    """The MTP drafts are argmaxes (q one-hot): a draft d passes with probability p(d)
    and after a rejection the token follows p less d, so the first token follows p_0 and,
    given d_1 accepted, the second p_1; all read back once, nothing synchronised before."""
    out, accepted = _on_device(P, [2, 4], TRIALS, SamplingParams(temperature=1.0), seed=6)
    assert_follows([t[0] for t in out], P[0])
    after_1 = [t[1] for t in out if t[0] == 2]
    assert len(after_1) > 3000
    assert_follows(after_1, P[1])
    assert sum(a >= 1 for a in accepted) / TRIALS == pytest.approx(float(P[0][2]), abs=0.02)
    assert all(len(t) == a + 1 for t, a in zip(out, accepted))


def test_device_verification_is_greedy_verification_for_greedy_requests() -> None:
    """Random logits, greedy and sampled requests of 0-3 drafts side by side: greedy ones
    accept exactly what `verify` accepts."""
    torch.manual_seed(1)
    greedy = SamplingParams(temperature=0.0)
    sampled = SamplingParams(temperature=0.7, top_k=5)
    ks = [3, 0, 2, 1, 3, 2]
    params = [greedy, sampled, greedy, greedy, sampled, greedy]
    logits = torch.randn(sum(1 + k for k in ks), 12)
    best = logits.argmax(-1).tolist()
    drafts: list[list[int]] = []
    at = 0
    for i, k in enumerate(ks):  # some drafts match the argmax, some not
        drafts.append([best[at + j] if (i + j) % 3 else (best[at + j] + 1) % 12 for j in range(k)])
        at += 1 + k
    row_drafts = torch.tensor([t for d in drafts for t in [*d, 0]])
    states = [SamplingState(p, [0]) for p in params]
    out = verify_on_device(logits, states, ks, row_drafts, torch.Generator().manual_seed(2))
    firsts = [sum(1 + k for k in ks[:i]) for i in range(len(ks))]
    want = verify(
        logits, [VerifyRequest(f, d, s) for f, d, s in zip(firsts, drafts, states)], None
    ).tokens
    accepted = out.accepted.tolist()
    for i, p in enumerate(params):
        got = out.tokens[i, : accepted[i] + 1].tolist()
        if p.greedy:
            assert got == want[i]
        else:  # its accepted drafts are its drafts; its last token is its own draw
            assert got[:-1] == drafts[i][: accepted[i]]
    assert 0 < sum(accepted) < sum(ks)
