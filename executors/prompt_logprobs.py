"""Prompt logprobs (vLLM's `prompt_logprobs`): for each prompt position p > 0, the logprob
of prompt token p given tokens [0, p), plus the top-k tokens there.

A prefill chunk covering positions [start, end) yields the rows that predict positions
start + 1 .. end (up to the prompt's last token); the runner holds the whole prompt for
such requests, so the row predicting a later chunk's first token is scored too. Rows are
computed in slices so that a long chunk never materialises [tokens, vocab] at once.
"""

from __future__ import annotations

import torch

from deepinfer.outputs import TokenLogprob

_ROWS_PER_SLICE = 256

# (request id, batch row, position of the predicted prompt token, that token's id, top-k)
PromptRow = tuple[str, int, int, int, int]


def chunk_rows(
    req_id: str, prompt_ids: list[int], start: int, end: int, first_row: int, k: int
) -> list[PromptRow]:
    """Rows of a chunk [start, end) whose prediction is a prompt token."""
    last = min(end, len(prompt_ids) - 1)
    return [(req_id, first_row + p - start, p + 1, prompt_ids[p + 1], k)
            for p in range(start, last)]  # fmt: skip


def compute(
    model: torch.nn.Module, hidden: torch.Tensor, rows: list[PromptRow]
) -> dict[str, dict[int, list[TokenLogprob]]]:
    """hidden: [T, H] final-normed states of the step -> req_id -> position -> [the prompt
    token's TokenLogprob (rank among all tokens), then the top-k with ranks 1..k]."""
    out: dict[str, dict[int, list[TokenLogprob]]] = {}
    for s in range(0, len(rows), _ROWS_PER_SLICE):
        part = rows[s : s + _ROWS_PER_SLICE]
        idx = torch.tensor([r[1] for r in part], device=hidden.device)
        logprobs = model.compute_logits(hidden[idx]).log_softmax(dim=-1)  # [n, vocab] float32
        targets = torch.tensor([r[3] for r in part], device=hidden.device)
        chosen = logprobs.gather(1, targets[:, None])  # [n, 1]
        ranks = (logprobs >= chosen).sum(dim=-1).tolist()
        k_max = max(r[4] for r in part)
        top_vals, top_ids = logprobs.topk(k_max, dim=-1) if k_max else (None, None)
        chosen_l = chosen[:, 0].tolist()
        tv = top_vals.tolist() if top_vals is not None else []
        ti = top_ids.tolist() if top_ids is not None else []
        for i, (req_id, _, pos, tok, k) in enumerate(part):
            row = [TokenLogprob(tok, chosen_l[i], ranks[i])]
            row += [TokenLogprob(ti[i][j], tv[i][j], j + 1) for j in range(k)]
            out.setdefault(req_id, {})[pos] = row
    return out
