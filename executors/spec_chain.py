"""Speculative steps chained on the device (async scheduling with drafts).

Under async scheduling the engine launches step N+1 before it reads step N. With drafts
in N the scheduler cannot know how many N accepts, so it schedules N+1 as if all were
accepted: each request's rows in N+1 sit `rejected` positions too far on. A verify step
whose results stay on the device (ModelRunner's device speculation) leaves a `Chained`
record for the step after it: each request's newest token and next drafts, and how many
drafts it rejected, as device tensors. N+1 is built on the host at the assumed positions,
its buffers are loaded, and then, still on the device, its token ids are filled in and
its positions, cache slots and sequence lengths moved back (`Shift`), so nothing waits
for N. The KV N wrote for rejected drafts lies past the moved positions and is
overwritten before any query reads it (attention reads keys up to its own position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executors.host_copy import to_device


@dataclass
class StepBuffers:
    """A step's inputs where the forward reads them on the device, for a fill to complete
    in place once they are loaded: the first T rows and R sequences are the step's (the
    rest is graph padding)."""

    input_ids: torch.Tensor  # [>= T] int64
    positions: torch.Tensor  # [>= T] int64
    slots: list[torch.Tensor]  # each [>= T] int64: every copy of the slot mapping read
    seq_lens: torch.Tensor  # [>= R] int64: keys each sequence attends to
    context_lens: torch.Tensor | None  # [>= R]; None: the forward derives it from seq_lens
    block_tables: torch.Tensor  # [>= R, W] int64: one row a sequence


@dataclass
class Chained:
    """What a verify step left on the device for the step after it; `PendingStep.tokens`
    holds its requests' next input ids, `width` a request ([B * width]: the newest token,
    then the drafts proposed, padded)."""

    width: int
    rejected: torch.Tensor  # [B + 1] int64: drafts each request rejected; a last 0


class Shift:
    """Moves rows built at assumed positions back by device amounts.

    amount: [R] int64 on the device, one per sequence; row_seq: each row's sequence (its
    block-table row), T entries on the host."""

    def __init__(self, amount: torch.Tensor, row_seq: list[int], block_size: int) -> None:
        self.amount = amount
        self.rows = len(row_seq)
        self.row_seq = to_device(row_seq, torch.int64, amount.device)  # [T]
        self.block_size = block_size

    def apply(self, buf: StepBuffers) -> None:
        t, r, bs = self.rows, self.amount.shape[0], self.block_size
        pos = buf.positions[:t]
        pos -= self.amount[self.row_seq]
        slots = buf.block_tables[self.row_seq, pos // bs] * bs + pos % bs  # [T]
        for s in buf.slots:
            s[:t] = slots
        buf.seq_lens[:r] -= self.amount
        if buf.context_lens is not None:
            buf.context_lens[:r] -= self.amount


def rows_by_sequence(query_lens: list[int]) -> list[int]:
    """Each row's sequence for sequences of `query_lens` rows, in order."""
    return [i for i, n in enumerate(query_lens) for _ in range(n)]
