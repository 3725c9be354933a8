"""The torch executor's host-memory KV tier (deepinfer/kv_cache/tiers.py's HOST): prefix
blocks HBM evicts are copied to host memory instead of dropped, and a prefix hit there is
copied back into the HBM blocks the scheduler allocated for it.

The buffer is [slots, layers, block_size, entry_dim] in the cache's dtype (layers: the
decoder layers, the MTP layers' last), one slot a block with all its layers contiguous,
so that each block crosses the link in one copy; pinned on CUDA. The core chooses the
slots (`TierLRU.slot`, least recently used out) and lists each step's copies
(`SchedulerOutput.kv_loads`, `kv_saves`); this object only performs them.

A step's copies, before its forward (`apply`), on one copy stream on CUDA (on a CPU,
in order as they are called):
1. the copy stream waits for the compute stream: a block's content is that of the steps
   launched before (a block the step in flight cached is written by it);
2. the saves' HBM blocks are gathered into a device buffer (this step may overwrite them:
   the allocation that evicted a block reuses it);
3. each load's block comes from that gather where this step saved its hash to its slot
   (evicted, then found again by a later allocation of the step), else from its host
   slot (host to device), and is scattered into its HBM block;
4. the compute stream waits for 2 and 3 only (an event): the forward waits for a device
   copy of the saves and for the loads it reads, never for the saves' way to the host;
5. the gathered saves go to their host slots (device to host; a slot saved twice in one
   step keeps the later), beside the forward. A later step's load of such a slot is
   queued behind it on the same stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.config import EngineConfig
from deepinfer.kv_cache.tiers import HOST
from deepinfer.outputs import KVLoad, KVSave, SchedulerOutput
from executors.kv_cache import PagedKVCache


def check_host_tier(config: EngineConfig) -> None:
    """ValueError for a host tier this executor does not keep: one on data-parallel ranks
    (the simulator cannot price it on their lock-step rounds either)."""
    if config.kv_host_cache_gib > 0 and config.data_parallel_size > 1:
        raise ValueError(
            f"kv_host_cache_gib={config.kv_host_cache_gib} with data_parallel_size="
            f"{config.data_parallel_size}: a host KV tier is one engine's, not data-parallel "
            "ranks'; use one of the two"
        )


class HostKVTier:
    """`num_slots` blocks of host memory behind one PagedKVCache."""

    def __init__(self, kv_cache: PagedKVCache, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"HostKVTier: {num_slots} slots; at least one")
        # Every cache tensor a block lives in: [num_blocks (+ 1 scratch), block_size, entry].
        self.layers = kv_cache.layers + kv_cache.mtp_layers
        first = self.layers[0]
        self.device = first.device
        on_cuda = self.device.type == "cuda"
        # [slots, layers, block_size, entry]
        self.buffer = torch.empty(
            (num_slots, len(self.layers), *first.shape[1:]), dtype=first.dtype, pin_memory=on_cuda
        )
        self.stream = torch.cuda.Stream(self.device) if on_cuda else None
        # The hash each slot's copy holds, as this tier wrote it: a load checks it (a step
        # scheduled and never launched, its requests failed, never copied its saves).
        self._held: list[int | None] = [None] * num_slots
        self.num_loaded = 0  # blocks copied in, over the steps
        self.num_saved = 0  # blocks copied out
        self._last_applied = -1  # the last step whose copies were queued (steps go in order)

    @property
    def num_slots(self) -> int:
        return len(self._held)

    @property
    def block_bytes(self) -> int:
        return self.buffer[0].nbytes

    def apply(self, out: SchedulerOutput) -> None:
        """Queue `out`'s loads and saves (the module's steps 1-5): the compute stream's
        next work, the step's forward, sees the loads in their blocks."""
        loads, saves = out.kv_loads, out.kv_saves
        if not loads and not saves:
            return
        self._check_tiers(loads, saves)
        sources = self._load_sources(loads, saves)
        self._last_applied = out.step_id
        self._queue(loads, saves, sources)

    def settle(self, out: SchedulerOutput) -> None:
        """`out` will never run (Executor.settle_kv_saves): copy its saves, unless its
        launch already queued them; its loads are moot (its requests start over)."""
        if out.step_id <= self._last_applied or not out.kv_saves:
            return
        self._check_tiers((), out.kv_saves)
        self._last_applied = out.step_id
        self._queue((), out.kv_saves, [])

    def _check_tiers(self, loads: Sequence[KVLoad], saves: Sequence[KVSave]) -> None:
        for copy in (*loads, *saves):
            if copy.tier != HOST:
                raise ValueError(
                    f"a KV {copy.tier} tier: the torch executor copies prefix blocks to its "
                    "own host memory only (kv_host_cache_gib); a shared store is a "
                    "simulator plan"
                )

    def _queue(
        self, loads: Sequence[KVLoad], saves: Sequence[KVSave], sources: Sequence[int | None]
    ) -> None:
        if self.stream is None:
            self._copy(loads, saves, sources)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            ready = self._copy(loads, saves, sources)
        assert ready is not None
        compute.wait_event(ready)

    def _load_sources(self, loads: Sequence[KVLoad], saves: Sequence[KVSave]) -> list[int | None]:
        """Per load: the index of the save of this step it reads (its hash saved to its
        slot), or None: its host slot, which must hold its hash already."""
        saved_at = {(s.slot, s.block_hash): j for j, s in enumerate(saves)}
        sources: list[int | None] = []
        for load in loads:
            j = saved_at.get((load.slot, load.block_hash))
            if j is None and self._held[load.slot] != load.block_hash:
                raise RuntimeError(
                    f"host KV tier: slot {load.slot} does not hold block {load.block_hash:#x} "
                    "(its save was never copied: a step dropped before its launch)"
                )
            sources.append(j)
        return sources

    def _copy(
        self, loads: Sequence[KVLoad], saves: Sequence[KVSave], sources: Sequence[int | None]
    ) -> torch.cuda.Event | None:
        """Steps 2-5 on the current stream; on CUDA the event that step 4 waits for."""
        dev = self.device
        gathered = None
        if saves:  # [saves, layers, block_size, entry]
            ids = torch.tensor([s.block_id for s in saves], dtype=torch.int64, device=dev)
            gathered = torch.stack([layer.index_select(0, ids) for layer in self.layers], dim=1)
        if loads:
            incoming = torch.empty(
                (len(loads), *self.buffer.shape[1:]), dtype=self.buffer.dtype, device=dev
            )
            for i, (load, j) in enumerate(zip(loads, sources)):
                if j is None:
                    incoming[i].copy_(self.buffer[load.slot], non_blocking=True)
                else:
                    assert gathered is not None
                    incoming[i].copy_(gathered[j])
            ids = torch.tensor([ld.block_id for ld in loads], dtype=torch.int64, device=dev)
            for i, layer in enumerate(self.layers):
                layer.index_copy_(0, ids, incoming[:, i])
            self.num_loaded += len(loads)
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record(self.stream)
        if gathered is not None:
            last = {s.slot: j for j, s in enumerate(saves)}  # a slot saved twice: the later
            for slot, j in last.items():
                self.buffer[slot].copy_(gathered[j], non_blocking=True)
                self._held[slot] = saves[j].block_hash
            self.num_saved += len(last)
        return ready
