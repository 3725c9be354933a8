"""Held-out evaluation of the demo model: next-token loss / perplexity and MTP top-1.

Windows of seq_len + 1 tokens with stride seq_len over the held-out stream
(`corpus.windows`); every target is predicted with at most seq_len - 1 tokens of
context from its window. The MTP layer is scored on the token after next at
positions 0 .. seq_len - 2 of each window, fed the main model's hidden state and
the true next token (teacher forcing, as in training).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .corpus import Document, encode_documents, windows
from .modeling import MTPModule, forward_losses


@torch.no_grad()
def evaluate(
    model: nn.Module,
    mtp: MTPModule,
    stream: torch.Tensor,
    seq_len: int,
    *,
    batch_size: int = 8,
    max_windows: int | None = None,
    device: str = "cpu",
    autocast: bool = False,
) -> dict:
    """Sums over every window, then means: loss (nats/token), perplexity, top-1 rates."""
    w = windows(stream, seq_len, max_windows)  # [n, seq_len + 1]
    nll = mtp_nll = 0.0
    main_hits = mtp_hits = 0
    main_n = mtp_n = 0
    for chunk in w.split(batch_size) if w.shape[0] else ():
        chunk = chunk.to(device)
        with torch.autocast(chunk.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss, mtp_loss, logits, mtp_logits = forward_losses(model, mtp, chunk)
        y = chunk[:, 1:]  # [B, T]
        nll += float(loss) * y.numel()
        mtp_nll += float(mtp_loss) * y[:, 1:].numel()
        main_hits += int((logits.argmax(-1) == y).sum())
        mtp_hits += int((mtp_logits.argmax(-1) == y[:, 1:]).sum())
        main_n += y.numel()
        mtp_n += y[:, 1:].numel()
    loss = nll / max(main_n, 1)
    return {
        "windows": int(w.shape[0]),
        "tokens": main_n,
        "loss": loss,
        "perplexity": math.exp(loss),
        "top1": main_hits / max(main_n, 1),
        "mtp_loss": mtp_nll / max(mtp_n, 1),
        "mtp_top1": mtp_hits / max(mtp_n, 1),
    }


@contextmanager
def expert_loads(model: nn.Module, mtp: MTPModule) -> Iterator[dict[str, list[float]]]:
    """Within the block, count each MoE layer's routed tokens per expert; on exit the
    yielded dict holds every layer's load fractions ("layer 4 (MTP)" for the MTP block)."""
    n = model.config.num_hidden_layers
    routers = {
        f"layer {i}": layer.mlp.gate
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "gate")
    }
    routers[f"layer {n} (MTP)"] = mtp.body.layers[0].mlp.gate
    counts = {k: torch.zeros(r.e_score_correction_bias.numel()) for k, r in routers.items()}

    def hook(key: str):
        def count(module: nn.Module, args, output) -> None:
            ids = next(o for o in output if not torch.is_floating_point(o))  # [T, k]
            counts[key] += torch.bincount(ids.reshape(-1).cpu(), minlength=counts[key].numel())

        return count

    handles = [r.register_forward_hook(hook(k)) for k, r in routers.items()]
    result: dict[str, list[float]] = {}
    try:
        yield result
    finally:
        for h in handles:
            h.remove()
        result.update({k: (c / c.sum().clamp(min=1)).tolist() for k, c in counts.items()})


def pick_sample(
    tok, heldout: list[Document], max_tokens: int, max_doc_tokens: int
) -> list[Document]:
    """A few whole held-out files (path-hash order) for tests to re-score on CPU."""
    order = sorted(heldout, key=lambda d: hashlib.sha1(d.path.encode()).digest())
    picked, total = [], 0
    for doc in order:
        n = len(tok.encode(doc.text, add_special_tokens=False).ids) + 2
        if n > max_doc_tokens or total + n > max_tokens:
            continue
        picked.append(doc)
        total += n
    return picked


def sample_loss(
    model: nn.Module, mtp: MTPModule, tok, docs: list[Document], seq_len: int, device: str
) -> dict:
    stream = encode_documents(tok, docs)
    return evaluate(model, mtp, stream, seq_len, device=device)
