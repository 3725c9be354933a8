"""A request's KV in and out of the paged cache (deepinfer/kv_cache/handover.py).

`export` gathers a request's positions [0, n) from every layer into one contiguous
tensor; `add` keeps an imported one until the engine schedules its request with the
block table, and `apply` (each launch, before the forward) scatters it into the blocks
the scheduler gave the request, past those that held their content already (prefix-cache
hits: they hold the same tokens' KV, and other requests may be reading them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch

from deepinfer.errors import RequestFailed
from deepinfer.kv_cache.handover import KVHandover
from deepinfer.outputs import SchedulerOutput
from executors.kv_cache import PagedKVCache


class KVTransfer:
    """Exports from and pending imports into one PagedKVCache (req_id -> handover).
    imports: the engine's role is decode (only such an engine counts a prompt it never
    computed as computed, so only it imports)."""

    def __init__(self, kv_cache: PagedKVCache, imports: bool) -> None:
        self.kv_cache = kv_cache
        self.imports = imports
        self._pending: dict[str, KVHandover] = {}
        self.num_imported_tokens = 0  # positions written from imports (hits are skipped)

    @property
    def layers(self) -> list[torch.Tensor]:
        """Every cache tensor a request's KV lives in, the MTP layers' last; each
        [num_blocks (+ 1 scratch), block_size, entry_dim]."""
        return self.kv_cache.layers + self.kv_cache.mtp_layers

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def export(self, block_table: Sequence[int], num_tokens: int) -> torch.Tensor:
        """Positions [0, num_tokens) of the request with this table:
        [num_tokens, layers, entry_dim], a copy (its blocks may be reused next step)."""
        slots = self._slots(block_table, 0, num_tokens)
        return torch.stack([_flat(layer).index_select(0, slots) for layer in self.layers], dim=1)

    def add(self, handover: KVHandover) -> None:
        """Keep `handover` for its request's first schedule; ValueError when its KV
        cannot be this cache's."""
        if not self.imports:
            raise ValueError(
                f"request {handover.req_id!r}: this engine computes its prompts (its role is "
                "not decode): it imports no KV"
            )
        kv, first = handover.kv, self.kv_cache.layers[0]
        expected = (handover.num_tokens, len(self.layers), first.shape[-1])
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != expected:
            shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
            raise ValueError(
                f"request {handover.req_id!r}: imported KV of shape {shape}, this cache "
                f"takes {expected} (tokens, layers with the MTP layers', entry)"
            )
        if kv.dtype != first.dtype:
            raise ValueError(
                f"request {handover.req_id!r}: imported KV in {kv.dtype}, this cache "
                f"holds {first.dtype}"
            )
        if handover.req_id in self._pending:
            raise ValueError(f"request {handover.req_id!r}: its KV was imported already")
        self._pending[handover.req_id] = dataclasses.replace(handover, kv=kv.to(first.device))

    def forget(self, req_ids: Iterable[str]) -> None:
        """These requests ended (or lost their blocks): their imports will never be used."""
        for req_id in req_ids:
            self._pending.pop(req_id, None)

    def apply(self, out: SchedulerOutput) -> None:
        """On a decode engine: fill, from its import, each request `out` sends with its
        block table that counts more tokens computed than its cached blocks hold.
        RequestFailed names every such request whose KV never arrived, or
        arrived for another length; then nothing is written."""
        if not self.imports:
            return
        self.forget(out.finished_req_ids | out.preempted_req_ids)
        bs = self.kv_cache.block_size
        errors: dict[str, str] = {}
        todo = []
        for sr in out.scheduled:
            start = sr.num_cached_blocks * bs
            if sr.block_table is None or sr.num_computed_tokens <= start:
                continue
            handover = self._pending.get(sr.req_id)
            if handover is None:
                errors[sr.req_id] = (
                    f"role='decode': the step counts {sr.num_computed_tokens} of its tokens "
                    "computed but its prompt's KV never arrived (no import_kv): nothing to "
                    "decode from"
                )
            elif handover.num_tokens != sr.num_computed_tokens:
                errors[sr.req_id] = (
                    f"its imported KV holds {handover.num_tokens} tokens, the step counts "
                    f"{sr.num_computed_tokens} computed"
                )
            else:
                todo.append((sr.block_table, start, handover))
        if errors:
            raise RequestFailed(errors)
        for table, start, handover in todo:
            del self._pending[handover.req_id]
            slots = self._slots(table, start, handover.num_tokens)
            kv = handover.kv[start:]  # [tokens, layers, entry]
            self.num_imported_tokens += len(kv)
            for i, layer in enumerate(self.layers):
                _flat(layer).index_copy_(0, slots, kv[:, i])

    def _slots(self, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """The cache rows of positions [start, end) of a request with this table: [n]."""
        bs = self.kv_cache.block_size
        pos = torch.arange(start, end)
        table = torch.tensor(list(block_table), dtype=torch.int64)
        slots = table[pos // bs] * bs + pos % bs
        return slots.to(self.kv_cache.layers[0].device)


def _flat(layer: torch.Tensor) -> torch.Tensor:
    """[blocks, block_size, entry] as [blocks * block_size, entry], the same storage."""
    return layer.view(-1, layer.shape[-1])
