"""The KV tiers below HBM as the simulator sizes, prices and reports them.

The rules (what moves where, LRU per tier) are the core's (deepinfer/kv_cache/tiers.py);
here: each tier's size in GiB turned into blocks of the model's KV bytes, the link a load
crosses (bandwidth and latency: `sim/cost_model.py`'s `KVLoadPricing` prices a step's
loads), and the report's figures (hits per tier over the prompt blocks looked up, bytes
moved per tier).

Saving a block to a lower tier costs the step nothing: the torch executor gathers the
step's saves with a device copy and sends them to the host on a stream of their own
beside the forward (executors/host_kv_tier.py), and a step waits only for the loads it
needs, and only for those that cross a link (the core's `step_copies`: a block the step
saved and loads back is a device copy from the save). The bytes saved are reported, so a
run whose saves would exceed a link's bandwidth shows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deepinfer.config import EngineConfig
from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.kv_cache.tiers import HBM, HOST, LOWER_TIERS, STORE, KVTiers, TierLRU
from sim.cost_model import KVLoadPricing

GIB = 1 << 30


@dataclass(frozen=True)
class TierSpec:
    """One lower tier: its size, and the link a load from it crosses into HBM."""

    size_gib: float
    bandwidth: float  # bytes/s
    latency_s: float  # fixed cost of one step's loads from this tier

    def capacity_blocks(self, block_bytes: int) -> int:
        """Blocks of `block_bytes` that fit (at least one: a size below one block is a
        tier of one block, not an error)."""
        return max(1, int(self.size_gib * GIB) // block_bytes)

    def load_s(self, num_blocks: int, block_bytes: int) -> float:
        return self.latency_s + num_blocks * block_bytes / self.bandwidth


# Host DRAM over PCIe Gen5 x16 (64 GB/s a direction, ~50 achieved by pinned copies), and
# a store over one 400 Gb/s RDMA NIC (Mooncake's transfer engine): datasheet figures,
# not measured here.
DEFAULT_HOST = TierSpec(0.0, bandwidth=50e9, latency_s=10e-6)
DEFAULT_STORE = TierSpec(0.0, bandwidth=50e9, latency_s=20e-6)


@dataclass(frozen=True)
class KVTierSpec:
    """The tiers of one engine (a cluster's store is one object all its engines share)."""

    host: TierSpec | None = None
    store: TierSpec | None = None

    @property
    def configured(self) -> bool:
        return self.host is not None or self.store is not None

    def tier(self, name: str) -> TierSpec | None:
        return self.host if name == HOST else self.store

    @staticmethod
    def of_engine(engine: EngineConfig, host: TierSpec = DEFAULT_HOST) -> KVTierSpec:
        """An engine's own host tier (`kv_host_cache_gib`, over `host`'s link); no store."""
        if engine.kv_host_cache_gib <= 0:
            return KVTierSpec()
        return KVTierSpec(host=TierSpec(engine.kv_host_cache_gib, host.bandwidth, host.latency_s))

    def build(self, block_bytes: int, store: TierLRU | None = None) -> KVTiers | None:
        """The core's tiers for one engine: its own host tier, and `store` (the shared one,
        made once by `shared_store`) where a store is configured. None: no tier."""
        if not self.configured:
            return None
        host = None
        if self.host is not None:
            host = TierLRU(HOST, self.host.capacity_blocks(block_bytes))
        if self.store is not None and store is None:
            raise ValueError("KVTierSpec.build: a store is configured; pass the shared one")
        return KVTiers(host, store if self.store is not None else None)

    def load_pricing(self, block_bytes: int) -> KVLoadPricing | None:
        """What a step's loads from these tiers cost (None: no tier, nothing to load)."""
        if not self.configured:
            return None
        links = {}
        for name in LOWER_TIERS:
            t = self.tier(name)
            if t is not None:
                links[name] = (t.bandwidth, t.latency_s)
        return KVLoadPricing(block_bytes, links)

    def shared_store(self, block_bytes: int) -> TierLRU | None:
        if self.store is None:
            return None
        return TierLRU(STORE, self.store.capacity_blocks(block_bytes))

    def to_meta(self, block_bytes: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in LOWER_TIERS:
            t = self.tier(name)
            if t is not None:
                out[name] = {
                    "size_gib": t.size_gib,
                    "capacity_blocks": t.capacity_blocks(block_bytes),
                    "bandwidth_bytes_s": t.bandwidth,
                    "latency_s": t.latency_s,
                }
        return out


def tier_stats(engines: Sequence[tuple[KVCacheManager, int]]) -> dict[str, Any]:
    """Per tier, over the engines' requests started with a prefix lookup (`engines`: each
    engine's KV manager and its block's bytes): blocks (and tokens) hit over the prompt
    blocks looked up; bytes saved to and loaded from each lower tier; blocks dropped from
    the last one."""
    tiers = (HBM, *LOWER_TIERS)
    looked_up = 0
    hits = dict.fromkeys(tiers, 0)
    hit_tokens = dict.fromkeys(tiers, 0)
    saved = dict.fromkeys(LOWER_TIERS, 0)
    loaded = dict.fromkeys(LOWER_TIERS, 0)
    dropped = 0
    for kv, block_bytes in engines:
        looked_up += kv.num_prefix_blocks_looked_up
        for t in tiers:
            hits[t] += kv.prefix_hit_blocks[t]
            hit_tokens[t] += kv.prefix_hit_blocks[t] * kv.block_size
        if kv.tiers is not None:
            for t in LOWER_TIERS:
                saved[t] += kv.tiers.saved[t] * block_bytes
                loaded[t] += kv.tiers.loaded[t] * block_bytes
            dropped += kv.tiers.dropped
    rate = {t: hits[t] / looked_up if looked_up else None for t in tiers}
    total = sum(hits.values())
    return {
        "prompt_blocks_looked_up": looked_up,
        "hit_blocks": hits,
        "hit_tokens": hit_tokens,
        "hit_rate": rate | {"total": total / looked_up if looked_up else None},
        "bytes_saved": saved,
        "bytes_loaded": loaded,
        "blocks_dropped": dropped,
    }


def kv_tiers_meta(
    tiers: dict[str, Any], engines: Sequence[tuple[KVCacheManager, int]]
) -> dict[str, Any]:
    """What a report says of the KV tiers (`tiers`: `KVTierSpec.to_meta` of the tiers
    configured; HBM's hits are reported even where no lower tier is)."""
    return {"tiers": tiers, **tier_stats(engines)}


def tiers_line(meta: dict[str, Any]) -> str:
    """One summary line: hit rates by tier and bytes moved (`kv_tiers_meta`)."""
    rate = meta["hit_rate"]

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    line = f"prefix hits over {meta['prompt_blocks_looked_up']} prompt blocks: HBM {pct(rate[HBM])}"
    configured = meta["tiers"]
    for name in LOWER_TIERS:
        if name in configured or f"{name}_per_pool" in configured:
            line += (
                f", {name} {pct(rate[name])} ({meta['bytes_loaded'][name] / 1e9:.2f} GB loaded, "
                f"{meta['bytes_saved'][name] / 1e9:.2f} GB saved)"
            )
    line += f"; total {pct(rate['total'])}"
    if meta["tiers"]:
        line += f"; {meta['blocks_dropped']} blocks dropped from the last tier"
    return line
