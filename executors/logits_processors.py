"""What sampling does to the logits before the draw (executors/sampler.py's steps 2-5):
min_tokens, the repetition / frequency / presence penalties, then for the rows that
sample temperature, min-p, top-k and top-p (`process_logits`). Speculative decoding
(executors/spec_decode.py) verifies drafts against exactly these distributions. Every step is
row-wise, and an exact identity for a row that disables it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executors.host_copy import to_device, to_device_async
from executors.sampling_state import SamplingState


def rows_of(rows: list[int], n: int, device: torch.device) -> slice | torch.Tensor:
    """An index of `rows` among n: a slice when they are all of them, in order."""
    if rows == list(range(n)):
        return slice(None)
    return to_device(rows, torch.int64, device)


def _counts(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Occurrences of each token per row. -> [num_reqs, vocab] float32."""
    width = max((len(r) for r in ids), default=0)
    padded = torch.full((len(ids), width + 1), vocab, dtype=torch.long)  # vocab: padding bin
    for i, row in enumerate(ids):
        padded[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    padded = padded.clamp_(0, vocab).to(device)
    counts = torch.zeros(len(ids), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalise tokens already seen, as HF and vLLM do.

    Repetition (tokens in prompt or output): positive logits are divided by the
    penalty, negative ones multiplied. Frequency subtracts penalty * count and
    presence subtracts penalty once, over output tokens only. Defaults (1, 0, 0)
    leave a row bit-for-bit unchanged.
    logits: [num_reqs, vocab]; presence, frequency, repetition: [num_reqs].
    """
    vocab = logits.shape[-1]
    out_counts = _counts(output_ids, vocab, logits.device)  # [num_reqs, vocab]
    seen = (_counts(prompt_ids, vocab, logits.device) > 0) | (out_counts > 0)
    rep = torch.where(seen, repetition[:, None].to(logits), torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency[:, None].to(logits) * out_counts
    return logits - presence[:, None].to(logits) * (out_counts > 0).to(logits)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits: [num_reqs, vocab] / temperature: [num_reqs] (> 0; use 1 for greedy rows)."""
    return logits / temperature[:, None].to(logits)


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value are kept). k <= 0: off.
    logits: [num_reqs, vocab]; k: [num_reqs] int, best on the host (its max sizes the
    top-k: read from the device, it would wait for the step)."""
    k_max = min(int(k.max()), logits.shape[-1]) if k.numel() else 0
    if k_max <= 0:
        return logits
    k = to_device_async(k, logits.device).to(torch.long).clamp(max=logits.shape[-1])
    top = logits.topk(k_max, dim=-1).values  # [num_reqs, k_max], descending
    kth = top.gather(1, (k.clamp(min=1) - 1)[:, None])  # [num_reqs, 1]
    kth = kth.masked_fill((k <= 0)[:, None], float("-inf"))  # disabled rows keep all
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability reaches p (>= 1: off).
    logits: [num_reqs, vocab]; p: [num_reqs]."""
    p = p.to(logits)
    sorted_asc, order = logits.sort(dim=-1, descending=False)  # [num_reqs, vocab]
    cum = sorted_asc.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= (1 - p)[:, None]
    drop_sorted[:, -1] = False  # the most likely token always survives
    drop_sorted &= (p < 1)[:, None]
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top one's (0: off).
    logits: [num_reqs, vocab]; min_p: [num_reqs]."""
    probs = logits.softmax(dim=-1)  # [num_reqs, vocab]
    threshold = min_p[:, None].to(logits) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def suppress_stop_tokens(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """min_tokens: EOS (unless ignore_eos) and stop_token_ids get -inf while a row
    has fewer than min_tokens outputs. logits: [num_reqs, vocab]."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        if len(s.output_token_ids) >= s.params.min_tokens:
            continue
        stops = list(s.params.stop_token_ids)
        if s.eos_token_id is not None and not s.params.ignore_eos:
            stops.append(s.eos_token_id)
        for t in stops:
            if 0 <= t < vocab:
                rows.append(i)
                cols.append(t)
    if not rows:
        return logits
    logits = logits.clone()
    logits[rows, cols] = float("-inf")
    return logits


@dataclass
class Processed:
    """Logits after the history-dependent steps, and what random rows sample from."""

    logits: torch.Tensor  # [num_reqs, vocab] after min_tokens and penalties: greedy takes argmax
    random_rows: list[int]  # rows whose params sample (temperature > 0)
    probs: torch.Tensor | None  # [len(random_rows), vocab]: their processed distribution


def process_logits(logits: torch.Tensor, states: list[SamplingState]) -> Processed:
    """Steps 2-5 of the module docstring short of the draw: min_tokens, penalties, then
    for random rows temperature, min-p, top-k, top-p and softmax. Speculative decoding
    samples drafts from, and verifies them against, exactly these distributions.
    logits: [num_reqs, vocab] float32."""
    device = logits.device
    params = [s.params for s in states]
    logits = suppress_stop_tokens(logits, states)
    if any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in params):
        logits = apply_penalties(
            logits,
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            _row_tensor([p.presence_penalty for p in params], device),
            _row_tensor([p.frequency_penalty for p in params], device),
            _row_tensor([p.repetition_penalty for p in params], device),
        )
    rnd = [i for i, p in enumerate(params) if not p.greedy]
    if not rnd:
        return Processed(logits, rnd, None)
    sub = [params[i] for i in rnd]
    x = logits[rows_of(rnd, len(params), device)]
    x = apply_temperature(x, _row_tensor([p.temperature for p in sub], device))
    if any(p.min_p > 0 for p in sub):
        x = apply_min_p(x, _row_tensor([p.min_p for p in sub], device))
    if any(p.top_k > 0 for p in sub):
        x = apply_top_k(x, torch.tensor([p.top_k for p in sub]))
    if any(p.top_p < 1 for p in sub):
        x = apply_top_p(x, _row_tensor([p.top_p for p in sub], device))
    return Processed(logits, rnd, x.softmax(dim=-1))


def _row_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device)
