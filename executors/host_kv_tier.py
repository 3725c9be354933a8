"""The torch executor's host-memory KV tier (deepinfer/kv_cache/tiers.py's HOST): prefix
blocks HBM evicts are copied to host memory instead of dropped, and a prefix hit there is
copied back into the HBM blocks the scheduler allocated for it.

The buffer is [slots, layers, block_size, entry_dim] in the cache's dtype (layers: the
decoder layers, the MTP layers' last), one slot a block with all its layers contiguous,
so that each block crosses the link in one copy; pinned on CUDA. The core chooses the
slots (`TierLRU.slot`, least recently used out) and lists each step's copies
(`SchedulerOutput.kv_loads`, `kv_saves`); this object only performs them.

A step's copies are queued at its launch, before its forward (`apply`). On CUDA they run
on two streams of the tier's own: the copy stream (gathers and loads: the forward waits
for them) and the save stream (the saves' way to the host: only a later load of their slot
waits for it); on a CPU they run in order as they are called.
1. the copy stream waits for the compute stream: a block's content is that of the steps
   launched before (a block the step in flight cached is written by it);
2. the saves' HBM blocks are gathered into a device buffer (this step may overwrite them:
   the allocation that evicted a block reuses it);
3. each load's block comes from that gather where this step saved its hash to its slot
   (the core's `step_copies`: evicted, then found again by a later allocation of the
   step), else from its host slot (host to device), once the save still writing that slot,
   if any, is done (its fence, `PendingSaves`); then the blocks are scattered into their
   HBM blocks;
4. the copy stream records `ready` after 2 and 3, and the compute stream waits for it:
   the forward waits for a device copy of its saves and for its loads, never for a save's
   way to the host (an earlier step's or its own) unless a load reads the slot it writes;
5. the save stream waits for `ready`, copies the gathered saves to their host slots
   (device to host; a slot saved twice in one step keeps the later) beside the forward,
   and records their fence. Waiting for `ready` puts every load queued so far (this
   step's and the earlier steps', all before it on the copy stream) before a save that
   overwrites its slot. The gather buffer, allocated on the copy stream, is marked used by
   the save stream (`record_stream`): the allocator hands its memory out again only once
   the save is done.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.config import EngineConfig
from deepinfer.kv_cache.tiers import HOST, StepCopies, step_copies
from deepinfer.outputs import KVLoad, KVSave, SchedulerOutput
from executors.host_copy import to_device_async
from executors.kv_cache import PagedKVCache
from executors.pending_saves import PendingSaves


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
        # The module's two streams: gathers and loads; saves to the host.
        self.stream = torch.cuda.Stream(self.device) if on_cuda else None
        self.save_stream = torch.cuda.Stream(self.device) if on_cuda else None
        self.pending: PendingSaves[torch.cuda.Event] = PendingSaves(torch.cuda.Event.query)
        # The hash each slot's copy holds, as this tier wrote it: a load checks it (a step
        # scheduled and never launched, its requests failed, never copied its saves).
        self._held: list[int | None] = [None] * num_slots
        self.num_loaded = 0  # blocks copied in, over the steps
        self.num_saved = 0  # blocks copied out
        self._last_applied = -1  # the last step whose copies were queued (steps go in order)
        if on_cuda:
            self._warm_up()

    def _warm_up(self) -> None:
        """Every copy kernel once, on the tier's streams, before any step: CUDA loads a
        kernel on its first launch (lazy module loading), which may wait for all the work
        queued on the device, so a first load launched behind a large save would hold the
        forward until that save has crossed the link. Block 0 goes to slot 0 and back
        (unchanged: nothing has written the cache yet); the slot is then free again."""
        save, load = KVSave(HOST, 0, 0, 0), KVLoad(HOST, 0, 0, 0)
        self._queue((), (save,), step_copies((), (save,)))
        torch.cuda.synchronize(self.device)
        self._queue((load,), (), step_copies((load,), ()))
        torch.cuda.synchronize(self.device)
        self._held[0] = None
        self.num_loaded = self.num_saved = 0
        self.pending.fences([0])  # done: forgotten

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
        copies = step_copies(loads, saves)
        self._check_held(loads, copies)
        self._last_applied = out.step_id
        self._queue(loads, saves, copies)

    def settle(self, out: SchedulerOutput) -> None:
        """`out` will never run (Executor.settle_kv_saves): copy its saves, unless its
        launch already queued them; its loads are moot (its requests start over)."""
        if out.step_id <= self._last_applied or not out.kv_saves:
            return
        self._check_tiers((), out.kv_saves)
        self._last_applied = out.step_id
        self._queue((), out.kv_saves, step_copies((), out.kv_saves))

    def _check_tiers(self, loads: Sequence[KVLoad], saves: Sequence[KVSave]) -> None:
        for copy in (*loads, *saves):
            if copy.tier != HOST:
                raise ValueError(
                    f"a KV {copy.tier} tier: the torch executor copies prefix blocks to its "
                    "own host memory only (kv_host_cache_gib); a shared store is a "
                    "simulator plan"
                )

    def _check_held(self, loads: Sequence[KVLoad], copies: StepCopies) -> None:
        """A load from its host slot needs the slot to hold its hash already."""
        for load, source in zip(loads, copies.sources):
            if source is None and self._held[load.slot] != load.block_hash:
                raise RuntimeError(
                    f"host KV tier: slot {load.slot} does not hold block {load.block_hash:#x} "
                    "(its save was never copied: a step dropped before its launch)"
                )

    def _queue(self, loads: Sequence[KVLoad], saves: Sequence[KVSave], copies: StepCopies) -> None:
        if self.stream is None or self.save_stream is None:
            gathered = self._load(loads, saves, copies.sources, [])
            if gathered is not None:
                self._save(saves, copies.written, gathered)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        host_slots = [ld.slot for ld, j in zip(loads, copies.sources) if j is None]
        with torch.cuda.stream(self.stream):
            gathered = self._load(loads, saves, copies.sources, self.pending.fences(host_slots))
            ready = torch.cuda.Event()
            ready.record()
        compute.wait_event(ready)
        if gathered is None:
            return
        self.save_stream.wait_event(ready)
        with torch.cuda.stream(self.save_stream):
            self._save(saves, copies.written, gathered)
            fence = torch.cuda.Event()
            fence.record()
        gathered.record_stream(self.save_stream)
        self.pending.saved((saves[j].slot for j in copies.written), fence)

    def _load(
        self,
        loads: Sequence[KVLoad],
        saves: Sequence[KVSave],
        sources: Sequence[int | None],
        fences: Sequence[torch.cuda.Event],
    ) -> torch.Tensor | None:
        """Steps 2 and 3 on the current stream, after `fences` for the loads from host
        slots; returns the gathered saves [saves, layers, block_size, entry] (None: no
        save)."""
        dev = self.device
        gathered = None
        if saves:
            ids = self._ids([s.block_id for s in saves])
            gathered = torch.stack([layer.index_select(0, ids) for layer in self.layers], dim=1)
        if not loads:
            return gathered
        incoming = torch.empty(
            (len(loads), *self.buffer.shape[1:]), dtype=self.buffer.dtype, device=dev
        )
        for i, j in enumerate(sources):  # device copies first: they wait for no save
            if j is not None:
                assert gathered is not None
                incoming[i].copy_(gathered[j])
        for fence in fences:
            fence.wait()
        for i, (load, j) in enumerate(zip(loads, sources)):
            if j is None:
                incoming[i].copy_(self.buffer[load.slot], non_blocking=True)
        ids = self._ids([ld.block_id for ld in loads])
        for i, layer in enumerate(self.layers):
            layer.index_copy_(0, ids, incoming[:, i])
        self.num_loaded += len(loads)
        return gathered

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        """Block ids on the device, through pinned memory: a copy from pageable memory would
        make the host wait for the copy stream, and so for the step before's forward."""
        return to_device_async(torch.tensor(block_ids, dtype=torch.int64), self.device)

    def _save(
        self, saves: Sequence[KVSave], written: Sequence[int], gathered: torch.Tensor
    ) -> None:
        """Step 5's copies on the current stream: the saves `written` (indices into
        `saves` and `gathered`) to their host slots."""
        for j in written:
            save = saves[j]
            self.buffer[save.slot].copy_(gathered[j], non_blocking=True)
            self._held[save.slot] = save.block_hash
        self.num_saved += len(written)
