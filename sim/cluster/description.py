"""A cluster description: pools of instances behind routers, the links between them, the
price of each GPU (`load_cluster` reads it from YAML or JSON; `replicas` builds the
simple case of N colocated instances).

    model: deepseek-v2-lite
    router: prefix-affinity          # or {policy: prefix-affinity, max_imbalance: 8}
    decode_router: least-kv          # PD only: which decode instance takes a handover
    pools:
      - {name: prefill, role: prefill, count: 2, hardware: h200, engine: {max_num_seqs: 64}}
      - {name: decode, role: decode, count: 4, hardware: h200}
    links:
      inter_node: {bandwidth_gb_s: 50, latency_us: 10}
    kv_transfer: {link: inter_node, layerwise: true}
    kv_tiers:                        # below each instance's HBM (deepinfer/kv_cache/tiers.py)
      host: {size_gib: 64, bandwidth_gb_s: 50, latency_us: 10}    # per instance, over PCIe
      store: {size_gib: 2048, bandwidth_gb_s: 50, latency_us: 20} # one, shared by all
    prices: {h200: 3.5}              # US$ per GPU-hour (overrides sim/data/gpu_prices.json)

A pool's host tier is its engine's kv_host_cache_gib where that is given (> 0), else
kv_tiers.host's size; its link is kv_tiers.host's (or the default PCIe figure).

A wrong key or value raises ClusterError naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.config import EngineConfig, EngineRole
from deepinfer.routing.policies import ROUTER_OPTIONS, ROUTERS, make_router
from sim.kv_tiers import DEFAULT_HOST, DEFAULT_STORE, KVTierSpec, TierSpec

ROLES = ("colocated", "prefill", "decode")
PRICES_FILE = Path(__file__).parent.parent / "data" / "gpu_prices.json"


class ClusterError(ValueError):
    """A cluster description that cannot be simulated; the message names the key."""


@dataclass(frozen=True)
class RouterSpec:
    policy: str = "least-requests"
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Link:
    """One direction of a link: bytes/s, and the fixed cost of a transfer."""

    bandwidth: float
    latency_s: float


@dataclass(frozen=True)
class PoolSpec:
    """`count` instances alike: each one EngineCore of `engine` on its GPUs."""

    name: str
    role: str
    count: int
    hardware: str
    engine: EngineConfig
    model: str | None = None  # None: the cluster's

    @property
    def gpus_per_instance(self) -> int:
        return self.engine.data_parallel_size

    @property
    def num_gpus(self) -> int:
        return self.count * self.gpus_per_instance


@dataclass(frozen=True)
class ClusterSpec:
    model: str
    pools: tuple[PoolSpec, ...]
    router: RouterSpec = field(default_factory=RouterSpec)
    decode_router: RouterSpec | None = None  # PD only
    links: Mapping[str, Link] = field(default_factory=dict)
    kv_link: str = "inter_node"
    layerwise: bool = True  # a prompt's KV leaves layer by layer as the prefill computes it
    prices: Mapping[str, float] = field(default_factory=dict)  # US$ per GPU-hour, by GPU
    seed: int = 0
    source: str = "cluster"
    # The KV tiers' links and the shared store; a pool's host size is its engine's
    # kv_host_cache_gib (`pool_tiers`).
    kv_tiers: KVTierSpec = field(default_factory=KVTierSpec)

    def pool_tiers(self, pool: PoolSpec) -> KVTierSpec:
        """The tiers of each instance of `pool`: its own host tier, the shared store."""
        link = self.kv_tiers.host or DEFAULT_HOST
        gib = pool.engine.kv_host_cache_gib
        host = TierSpec(gib, link.bandwidth, link.latency_s) if gib > 0 else None
        return KVTierSpec(host, self.kv_tiers.store)

    @property
    def disaggregated(self) -> bool:
        return any(p.role == "prefill" for p in self.pools)

    @property
    def entry_pools(self) -> list[PoolSpec]:
        """The pools arrivals are routed over (colocated, or the prefill pools)."""
        return [p for p in self.pools if p.role != "decode"]

    @property
    def decode_pools(self) -> list[PoolSpec]:
        return [p for p in self.pools if p.role == "decode"]

    @property
    def num_instances(self) -> int:
        return sum(p.count for p in self.pools)

    @property
    def num_gpus(self) -> int:
        return sum(p.num_gpus for p in self.pools)

    def kv_transfer_link(self) -> Link:
        return self.links[self.kv_link]


# Defaults: an RDMA NIC per GPU (400 Gb/s) between nodes, NVLink within one.
DEFAULT_LINKS = {
    "inter_node": Link(bandwidth=50e9, latency_s=10e-6),
    "intra_node": Link(bandwidth=450e9, latency_s=3e-6),
}


def default_prices() -> dict[str, float]:
    raw = json.loads(PRICES_FILE.read_text())
    return {k: float(v) for k, v in raw.items() if not k.startswith("_")}


def replicas(
    count: int, engine: EngineConfig, model: str, hardware: str, router: RouterSpec
) -> ClusterSpec:
    """`count` colocated instances of one engine behind `router` (`--replicas N`)."""
    pool = _pool({"count": count}, "replicas", engine, hardware, "--replicas")
    spec = ClusterSpec(
        model,
        (pool,),
        router,
        links=dict(DEFAULT_LINKS),
        prices=default_prices(),
        source="--replicas",
    )
    return _check(spec)


def load_cluster(
    path: str | Path, *, base_engine: EngineConfig | None = None, hardware: str = "h200"
) -> ClusterSpec:
    """The cluster described in `path` (YAML or JSON). Pools' engines start from
    `base_engine` (the command line's engine options), their `engine` keys override."""
    import yaml

    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ClusterError(f"{p}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ClusterError(f"{p}: not YAML or JSON: {e}") from None
    return cluster_from_dict(raw, source=str(p), base_engine=base_engine, hardware=hardware)


_TOP_KEYS = {
    "model", "pools", "router", "decode_router", "links", "kv_transfer", "kv_tiers", "prices",
    "seed",
}  # fmt: skip
_POOL_KEYS = {"name", "role", "count", "hardware", "engine", "model"}
_LINK_KEYS = {"bandwidth_gb_s", "latency_us"}
_TRANSFER_KEYS = {"link", "layerwise"}
_TIERS_KEYS = {"host", "store"}
_TIER_KEYS = {"size_gib", "bandwidth_gb_s", "latency_us"}


def cluster_from_dict(
    raw: Any,
    *,
    source: str = "cluster",
    base_engine: EngineConfig | None = None,
    hardware: str = "h200",
    model: str = "moonlight-16b-a3b",
) -> ClusterSpec:
    where = source
    _mapping(raw, where)
    _known(raw, _TOP_KEYS, where)
    if "pools" not in raw:
        raise ClusterError(f"{where}: no 'pools' (a list of pools of instances)")
    pools_raw = raw["pools"]
    if not isinstance(pools_raw, list) or not pools_raw:
        raise ClusterError(f"{where}: pools: expected a non-empty list of pools")
    base = base_engine or EngineConfig()
    pools = []
    for i, pr in enumerate(pools_raw):
        at = f"{where}: pools[{i}]"
        _mapping(pr, at)
        _known(pr, _POOL_KEYS, at)
        pools.append(_pool(pr, pr.get("name", f"pool{i}"), base, hardware, at))
    links = dict(DEFAULT_LINKS)
    links_raw = raw.get("links", {})
    _mapping(links_raw, f"{where}: links")
    for name, lr in links_raw.items():
        links[name] = _link(lr, f"{where}: links.{name}")
    transfer = raw.get("kv_transfer", {})
    _mapping(transfer, f"{where}: kv_transfer")
    _known(transfer, _TRANSFER_KEYS, f"{where}: kv_transfer")
    kv_link = transfer.get("link", "inter_node")
    if kv_link not in links:
        raise ClusterError(
            f"{where}: kv_transfer.link {kv_link!r}: no such link (links: {', '.join(links)})"
        )
    layerwise = transfer.get("layerwise", True)
    if not isinstance(layerwise, bool):
        raise ClusterError(f"{where}: kv_transfer.layerwise {layerwise!r}: expected true or false")
    prices = default_prices()
    prices_raw = raw.get("prices", {})
    _mapping(prices_raw, f"{where}: prices")
    for gpu, price in prices_raw.items():
        if not isinstance(price, (int, float)) or isinstance(price, bool) or price < 0:
            raise ClusterError(f"{where}: prices.{gpu} {price!r}: expected US$ per GPU-hour >= 0")
        prices[str(gpu).lower()] = float(price)
    seed = raw.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ClusterError(f"{where}: seed {seed!r}: expected an integer")
    tiers = _kv_tiers(raw.get("kv_tiers", {}), f"{where}: kv_tiers")
    if tiers.host is not None:  # the default host tier of pools whose engine gives none
        try:
            pools = [
                p
                if p.engine.kv_host_cache_gib > 0
                else dataclasses.replace(
                    p, engine=p.engine.replace(kv_host_cache_gib=tiers.host.size_gib)
                )
                for p in pools
            ]
        except ValueError as e:
            raise ClusterError(f"{where}: kv_tiers.host: {e}") from None
    spec = ClusterSpec(
        model=str(raw.get("model", model)),
        pools=tuple(pools),
        router=_router(raw.get("router", "least-requests"), f"{where}: router"),
        decode_router=(
            _router(raw["decode_router"], f"{where}: decode_router")
            if "decode_router" in raw
            else None
        ),
        links=links,
        kv_link=kv_link,
        layerwise=layerwise,
        prices=prices,
        seed=seed,
        source=source,
        kv_tiers=tiers,
    )
    return _check(spec)


def _kv_tiers(raw: Any, at: str) -> KVTierSpec:
    _mapping(raw, at)
    _known(raw, _TIERS_KEYS, at)
    found: dict[str, TierSpec] = {}
    for name, default in (("host", DEFAULT_HOST), ("store", DEFAULT_STORE)):
        if name not in raw:
            continue
        tier = raw[name]
        where = f"{at}.{name}"
        _mapping(tier, where)
        _known(tier, _TIER_KEYS, where)
        if "size_gib" not in tier:
            raise ClusterError(f"{where}: no size_gib (the tier's capacity in GiB)")
        values = {
            "size_gib": tier["size_gib"],
            "bandwidth_gb_s": tier.get("bandwidth_gb_s", default.bandwidth / 1e9),
            "latency_us": tier.get("latency_us", default.latency_s * 1e6),
        }
        for key, value in values.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ClusterError(f"{where}.{key} {value!r}: expected a number >= 0")
        if values["bandwidth_gb_s"] <= 0:
            raise ClusterError(f"{where}.bandwidth_gb_s {values['bandwidth_gb_s']!r}: must be > 0")
        if name == "store" and values["size_gib"] <= 0:
            raise ClusterError(f"{where}.size_gib {values['size_gib']!r}: must be > 0")
        found[name] = TierSpec(
            float(values["size_gib"]),
            float(values["bandwidth_gb_s"]) * 1e9,
            float(values["latency_us"]) * 1e-6,
        )
    return KVTierSpec(found.get("host"), found.get("store"))


def _pool(raw: Mapping[str, Any], name: Any, base: EngineConfig, hw: str, at: str) -> PoolSpec:
    role = raw.get("role", "colocated")
    if role not in ROLES:
        raise ClusterError(f"{at}: role {role!r}: expected one of {', '.join(ROLES)}")
    count = raw.get("count", 1)
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ClusterError(f"{at}: count {count!r}: expected an integer >= 1")
    hardware = str(raw.get("hardware", hw)).lower()
    engine_raw = raw.get("engine", {})
    _mapping(engine_raw, f"{at}.engine")
    if "role" in engine_raw:
        raise ClusterError(f"{at}.engine: role: give the pool's role (colocated, prefill, decode)")
    engine_role = {"colocated": EngineRole.NORMAL, "prefill": EngineRole.PREFILL}.get(
        role, EngineRole.DECODE
    )
    try:
        values = base.to_dict() | dict(engine_raw) | {"role": engine_role.value}
        engine = EngineConfig.from_dict(values, source=f"{at}.engine")
    except (TypeError, ValueError) as e:
        raise ClusterError(str(e) if str(e).startswith(at) else f"{at}.engine: {e}") from None
    model = raw.get("model")
    return PoolSpec(str(name), role, count, hardware, engine, None if model is None else str(model))


def _router(raw: Any, at: str) -> RouterSpec:
    if isinstance(raw, str):
        raw = {"policy": raw}
    _mapping(raw, at)
    policy = raw.get("policy")
    if policy not in ROUTERS:
        raise ClusterError(f"{at}: policy {policy!r}: expected one of {', '.join(ROUTERS)}")
    options = {k: v for k, v in raw.items() if k != "policy"}
    allowed = ROUTER_OPTIONS.get(policy, ())
    for key in options:
        if key not in allowed:
            takes = ", ".join(allowed) or "none"
            raise ClusterError(f"{at}: unknown option {key!r} for {policy} (options: {takes})")
    try:  # the policy's own checks of the values
        make_router(policy, 1, **options)
    except ValueError as e:
        raise ClusterError(f"{at}: {e}") from None
    return RouterSpec(policy, options)


def _link(raw: Any, at: str) -> Link:
    _mapping(raw, at)
    _known(raw, _LINK_KEYS, at)
    bw, lat = raw.get("bandwidth_gb_s"), raw.get("latency_us", 0.0)
    for key, value in (("bandwidth_gb_s", bw), ("latency_us", lat)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ClusterError(f"{at}.{key} {value!r}: expected a number >= 0")
    assert isinstance(bw, (int, float)) and isinstance(lat, (int, float))
    if bw <= 0:
        raise ClusterError(f"{at}.bandwidth_gb_s {bw!r}: must be > 0")
    return Link(bandwidth=float(bw) * 1e9, latency_s=float(lat) * 1e-6)


def _check(spec: ClusterSpec) -> ClusterSpec:
    """The rules the cluster simulation needs of a whole description."""
    at = spec.source
    roles = {p.role for p in spec.pools}
    if "colocated" in roles and len(roles) > 1:
        raise ClusterError(
            f"{at}: pools mix colocated with prefill/decode roles: a cluster is either "
            "colocated or disaggregated"
        )
    if ("prefill" in roles) != ("decode" in roles):
        raise ClusterError(f"{at}: a disaggregated cluster needs a prefill and a decode pool")
    if spec.decode_router is not None and "decode" not in roles:
        raise ClusterError(f"{at}: decode_router: the cluster has no decode pool")
    names = [p.name for p in spec.pools]
    if len(set(names)) != len(names):
        raise ClusterError(f"{at}: pool names repeat: {names}")
    for group in (spec.entry_pools, spec.decode_pools):
        sizes = {p.engine.block_size for p in group}
        if len(sizes) > 1:
            raise ClusterError(
                f"{at}: pools {[p.name for p in group]} share a router but not a block size "
                f"({sorted(sizes)}): a router compares their cached prefixes block by block"
            )
    for p in spec.pools:
        if spec.pool_tiers(p).configured and p.engine.data_parallel_size > 1:
            raise ClusterError(
                f"{at}: pool {p.name}: KV tiers with data_parallel_size="
                f"{p.engine.data_parallel_size}: the ranks' lock-step rounds do not price "
                "tier loads yet; drop kv_tiers (or kv_host_cache_gib) or the ranks"
            )
        if spec.kv_tiers.store is not None and not p.engine.enable_prefix_caching:
            raise ClusterError(
                f"{at}: kv_tiers.store: pool {p.name} has enable_prefix_caching=False, and "
                "the store holds prefix-cache blocks"
            )
        if p.hardware not in spec.prices:
            raise ClusterError(
                f"{at}: pool {p.name}: no price for GPU {p.hardware!r} (add prices.{p.hardware})"
            )
    return spec


def _mapping(raw: Any, at: str) -> None:
    if not isinstance(raw, Mapping):
        raise ClusterError(f"{at}: expected a mapping, got {type(raw).__name__}")


def _known(raw: Mapping[str, Any], keys: set[str], at: str) -> None:
    unknown = sorted(str(k) for k in raw if k not in keys)
    if unknown:
        raise ClusterError(f"{at}: unknown key(s) {unknown}; known: {sorted(keys)}")
