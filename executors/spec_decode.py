"""Draft verification: greedy prefix matching and lossless speculative (rejection) sampling.

A request with k drafts d_1..d_k is scored on 1 + k rows in one step: row j holds
the target's logits for its output n + j (n: outputs before the step), as if
d_1..d_j had been accepted, so each row is processed (min_tokens, penalties,
temperature, top-k/p, min-p: `logits_processors.process_logits`) with that history.

- Greedy requests accept the longest prefix of drafts equal to the rows' argmax,
  then take the next row's argmax: token for token what plain greedy decoding gives.
- Sampling requests accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), p_j the
  target's processed distribution and q_j the processed draft distribution d_j was
  sampled from (kept by the runner; drafts without one count as deterministic,
  q_j = one-hot); at the first rejection the token is drawn from
  normalize(max(0, p_j - q_j)), and after k acceptances the bonus from p_k. The
  output then has exactly the distribution of plain sampling (Leviathan et al.
  2023, Chen et al. 2023).

Randomness: a seeded request draws its acceptance tests from its own generator
(stream ACCEPT at the index of the first draft) and its token from the ordinary
stream at the index of that token, so its output is a function of its seed and its
drafts alone; unseeded requests share draws from the runner's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.sampling_params import SamplingParams
from executors.host_copy import to_device
from executors.logits_processors import process_logits, rows_of
from executors.sampler import SamplingState, gather_logprobs, random_sample, raw_logprobs
from executors.sampler import greedy as argmax_rows

ACCEPT_STREAM = 1  # seeded generator streams (sampler.SamplingState.seeded_generator)
DRAFT_STREAM = 2


@dataclass
class VerifyRequest:
    """One request's rows in the step's sampled logits."""

    first: int  # its first row in the logits
    drafts: list[int]  # k drafts: rows first..first + k verify them, row first + k is the bonus
    state: SamplingState
    draft_probs: torch.Tensor | None = None  # [>= k, vocab]: q the drafts were sampled from


@dataclass
class VerifyOutput:
    tokens: list[list[int]]  # per request: accepted drafts plus one sampled token
    logprobs: list[list] | None  # per row, as SamplerOutput.logprobs (None: none asked)


def row_states(state: SamplingState, drafts: list[int]) -> list[SamplingState]:
    """1 + len(drafts) views of `state`, row j with drafts d_1..d_j appended to its output
    history. A row shares `state` where the history cannot change its processing."""
    rows = [state]
    p = state.params
    history_matters = (
        p.repetition_penalty != 1
        or p.frequency_penalty != 0
        or p.presence_penalty != 0
        or len(state.output_token_ids) < p.min_tokens
    )
    for j in range(1, len(drafts) + 1):
        if not history_matters:
            rows.append(state)
            continue
        outputs = state.output_token_ids + drafts[:j]
        rows.append(SamplingState(p, state.prompt_token_ids, outputs, state.eos_token_id))
    return rows


def verify(
    logits: torch.Tensor,
    reqs: list[VerifyRequest],
    generator: torch.Generator | None,
    batch_invariant: bool = False,
) -> VerifyOutput:
    """Sample (and verify drafts) for every request. logits: [sum(1 + k), vocab], the
    requests' rows in order (`first` of each is the running sum). batch_invariant: the
    logprobs' log-softmax row by row, as `sample_tokens` computes it in that mode."""
    logits = logits.float()
    device = logits.device
    states = [s for r in reqs for s in row_states(r.state, r.drafts)]
    assert logits.shape[0] == len(states), (logits.shape, len(states))
    raw = raw_logprobs(logits, states, batch_invariant)
    proc = process_logits(logits, states)
    row_tokens = argmax_rows(proc.logits)  # [rows]: greedy requests' answers
    greedy_ids = row_tokens.tolist()
    tokens: list[list[int]] = [[] for _ in reqs]
    sampling = [i for i, r in enumerate(reqs) if not r.state.params.greedy]
    for i, r in enumerate(reqs):
        if r.state.params.greedy:
            ids = greedy_ids[r.first : r.first + 1 + len(r.drafts)]
            a = 0
            while a < len(r.drafts) and ids[a] == r.drafts[a]:
                a += 1
            tokens[i] = ids[: a + 1]
    if sampling:
        assert proc.probs is not None
        # Processed distributions of the random rows, which come in request order.
        where = {row: j for j, row in enumerate(proc.random_rows)}
        probs = proc.probs  # [random rows, vocab]
        accepted = _accept(probs, [reqs[i] for i in sampling], where, generator)
        dists = []
        gens = []
        for i, a in zip(sampling, accepted):
            r = reqs[i]
            p = probs[where[r.first + a]]  # [vocab]: the row of the token to sample
            if a < len(r.drafts):  # rejected d_{a+1}: sample max(0, p - q), renormalised
                residual = (p - _q_row(r, a, p)).clamp_(min=0)
                total = residual.sum()
                p = residual / total if total > 0 else p  # p == q: a rejection is impossible
            dists.append(p)
            n = len(r.state.output_token_ids)
            gens.append(r.state.seeded_generator(device, index=n + a))
        sampled = random_sample(torch.stack(dists), gens, generator).tolist()
        for i, a, t in zip(sampling, accepted, sampled):
            r = reqs[i]
            tokens[i] = r.drafts[:a] + [t]
            row_tokens[r.first + a] = t
    logprobs = None
    if raw is not None:
        for r, toks in zip(reqs, tokens):  # rows of accepted drafts chose the drafts
            row_tokens[r.first : r.first + len(toks)] = torch.tensor(toks, device=device)
        logprobs = gather_logprobs(raw, row_tokens, [s.params for s in states])
    return VerifyOutput(tokens, logprobs)


def _q_row(r: VerifyRequest, j: int, like: torch.Tensor) -> torch.Tensor:
    """q_j of request r (one-hot on the draft when its proposer kept no distribution)."""
    if r.draft_probs is not None:
        return r.draft_probs[j]
    q = torch.zeros_like(like)
    q[r.drafts[j]] = 1.0
    return q


def _accept(
    probs: torch.Tensor,
    reqs: list[VerifyRequest],
    where: dict[int, int],
    generator: torch.Generator | None,
) -> list[int]:
    """Number of leading drafts each sampling request accepts: d_j passes when
    u_j * q_j(d_j) < p_j(d_j), u_j ~ U[0, 1) (probability min(1, p / q)).
    probs: [random rows, vocab]; `where` maps a logits row to its row in probs."""
    with_drafts = [r for r in reqs if r.drafts]
    if not with_drafts:
        return [0] * len(reqs)
    device = probs.device
    rows = torch.tensor([where[r.first + j] for r in with_drafts for j in range(len(r.drafts))])
    ids = torch.tensor([d for r in with_drafts for d in r.drafts], device=device)  # [drafts]
    p_d = probs[rows.to(device), ids]  # [drafts]
    q_d = torch.cat([_q_of_drafts(r, device) for r in with_drafts])  # [drafts]
    u = _uniforms(with_drafts, device, generator)  # [drafts]
    passed = (u * q_d < p_d).tolist()
    accepted = []
    pos = 0
    for r in reqs:
        a = 0
        while a < len(r.drafts) and passed[pos + a]:
            a += 1
        pos += len(r.drafts)
        accepted.append(a)
    return accepted


def _q_of_drafts(r: VerifyRequest, device: torch.device) -> torch.Tensor:
    """q_j(d_j) for each draft of r: [k] (ones for drafts without a distribution)."""
    k = len(r.drafts)
    if r.draft_probs is None:
        return torch.ones(k, device=device)
    ids = torch.tensor(r.drafts, device=device)
    return r.draft_probs[torch.arange(k, device=device), ids]


def _uniforms(
    reqs: list[VerifyRequest], device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    """One U[0, 1) per draft: seeded requests from their own ACCEPT stream at the index
    of their first draft, the others from one shared draw."""
    n = sum(len(r.drafts) for r in reqs)
    u = torch.empty(n, device=device)
    shared = [r.state.params.seq_seed is None for r in reqs]
    if any(shared):
        noise = torch.rand(
            sum(len(r.drafts) for r, s in zip(reqs, shared) if s),
            generator=generator,
            device=device,
        )
    pos = taken = 0
    for r, s in zip(reqs, shared):
        k = len(r.drafts)
        if s:
            u[pos : pos + k] = noise[taken : taken + k]
            taken += k
        else:
            index = len(r.state.output_token_ids)
            gen = r.state.seeded_generator(device, index=index, stream=ACCEPT_STREAM)
            u[pos : pos + k] = torch.rand(k, generator=gen, device=device)
        pos += k
    return u


@dataclass
class DeviceVerify:
    """`verify_on_device`'s result, nothing read back."""

    tokens: torch.Tensor  # [B, W] int64: accepted drafts, then the sampled token; past it, any
    accepted: torch.Tensor  # [B] int64: drafts accepted


def history_free(params: SamplingParams, num_outputs: int) -> bool:
    """Whether the request's processed logits are the same whatever its recent tokens
    (no penalties, min_tokens met), so each of its rows can be verified from one state."""
    return (
        params.repetition_penalty == 1
        and not params.frequency_penalty
        and not params.presence_penalty
        and num_outputs >= params.min_tokens
    )


def verify_on_device(
    logits: torch.Tensor,
    states: list[SamplingState],
    num_drafts: list[int],
    draft_ids: torch.Tensor,
    generator: torch.Generator | None,
) -> DeviceVerify:
    """`verify` with no host sync: request i has 1 + num_drafts[i] consecutive rows of
    `logits` [N, vocab]; draft_ids [N] (device): the draft each row verifies (the input
    token after it; anything on a request's last row). Greedy rows accept matching
    argmaxes; random rows accept d with probability p(d) (the MTP drafts are argmaxes:
    q is one-hot) and after a rejection sample max(0, p - q), so sampling stays lossless.
    Unseeded requests whose processing reads no history only (`history_free`)."""
    device = logits.device
    rows = [s for s, k in zip(states, num_drafts) for _ in range(1 + k)]
    assert logits.shape[0] == len(rows), (logits.shape, len(rows))
    assert all(s.params.seq_seed is None for s in states)
    proc = process_logits(logits.float(), rows)
    tokens = argmax_rows(proc.logits)  # [N]
    is_draft = to_device(_draft_rows(num_drafts), torch.bool, device)  # [N]
    passed = tokens == draft_ids  # [N]
    if proc.random_rows:
        assert proc.probs is not None
        rnd = rows_of(proc.random_rows, len(rows), device)
        probs = proc.probs  # [R, vocab]
        d = draft_ids[rnd][:, None]  # [R, 1]
        u = torch.rand(d.shape[0], generator=generator, device=device)
        passed[rnd] = u < probs.gather(1, d)[:, 0]
        # After a rejection: p less the draft's one-hot q; a request's last row: p.
        residual = torch.where(is_draft[rnd][:, None], probs.scatter(1, d, 0.0), probs)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
        tokens[rnd] = random_sample(residual, [None] * d.shape[0], generator)
    passed &= is_draft
    grid = row_grid(num_drafts, device)  # [B, W]
    accepted = torch.cat([passed, passed.new_zeros(1)])[grid].long().cumprod(dim=1).sum(dim=1)
    return DeviceVerify(prefix_tokens(tokens, draft_ids, accepted, grid), accepted)


def row_grid(num_drafts: list[int], device: torch.device) -> torch.Tensor:
    """[B, W] (W = 1 + max drafts): the logits row of request i's j-th row, requests'
    1 + num_drafts[i] rows consecutive; padding points one past the last row (N)."""
    width = 1 + max(num_drafts)
    n = sum(num_drafts) + len(num_drafts)
    grid, start = [], 0
    for k in num_drafts:
        grid.append([start + j if j <= k else n for j in range(width)])
        start += 1 + k
    return to_device(grid, torch.int64, device)


def prefix_tokens(
    tokens: torch.Tensor, draft_ids: torch.Tensor, accepted: torch.Tensor, grid: torch.Tensor
) -> torch.Tensor:
    """Each request's output [B, W]: its first accepted[i] drafts, then the token its
    next row chose (past it: anything). tokens, draft_ids: [N] per row; grid: row_grid."""
    pad = tokens.new_zeros(1)
    col = torch.arange(grid.shape[1], device=grid.device)[None, :]
    drafts = torch.cat([draft_ids, pad])[grid]
    return torch.where(col < accepted[:, None], drafts, torch.cat([tokens, pad])[grid])


def _draft_rows(num_drafts: list[int]) -> list[bool]:
    """Per row, whether it verifies a draft (every row of a request but its last)."""
    return [j < k for k in num_drafts for j in range(1 + k)]
