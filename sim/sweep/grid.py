"""The sweep's grid: knob names mapped to lists of values, from a YAML/JSON file or flags.

Every combination of the listed values is one config (the cartesian product, in the
order the keys and values are given). Keys are the EngineConfig fields plus `model`,
`hardware`, `cost_model`, `acceptance_rate`, and `rate` (a list of fixed rates, or a
mapping of bisection bounds; see `RateSpec`). A bad key or value is a ValueError whose
one-line message names the key, so the CLI can print it and exit 2.

A cluster sweep names a base cluster (`cluster: FILE`, sim/cluster/description.py) and
varies its knobs by dotted path: `cluster.router`, `cluster.decode_router`,
`cluster.pools.NAME.count` (so the prefill:decode ratio), `cluster.pools.NAME.hardware`,
`cluster.pools.NAME.engine.FIELD` (draft length, DP size, ...), `cluster.links.LINK.FIELD`,
`cluster.kv_transfer.FIELD`; the engine knobs at the top level are every pool's defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.config import EngineConfig

SIM_KEYS = ("model", "hardware", "cost_model", "acceptance_rate")
RATE_KEY = "rate"
CLUSTER_KEY = "cluster"  # the base cluster file; "cluster.a.b" knobs vary its fields
DEFAULTS: dict[str, Any] = {
    "model": "moonlight-16b-a3b",
    "hardware": "h200",
    "cost_model": None,  # what simulate() picks: profiled where a profile exists, else analytic
    "acceptance_rate": 0.7,
}
# Fields that default to None ("derived") take an int when given.
_OPTIONAL_INT = ("num_gpu_blocks", "max_model_len")


def known_keys() -> list[str]:
    return [*EngineConfig.field_names(), *SIM_KEYS, RATE_KEY, CLUSTER_KEY]


@dataclass(frozen=True)
class RateSpec:
    """How rates are chosen per config: fixed `rates`, or a bisection between bounds.

    Bisection starts at `start` (default: the trace's own mean rate), doubles or halves
    until the SLO is crossed, then bisects geometrically until the passing and failing
    rates are within `rel_tol` of each other, or `max_points` rates were simulated.
    """

    rates: tuple[float, ...] = ()
    min: float = 0.05
    max: float = 1000.0
    start: float | None = None
    rel_tol: float = 0.05
    max_points: int = 16

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SweepConfig:
    """One point of the grid minus its rate: what `simulate` is called with."""

    model: str
    hardware: str
    cost_model: str | None
    acceptance_rate: float
    engine: dict[str, Any]  # every EngineConfig field, explicit (env defaults resolved here)
    varied: tuple[str, ...] = ()  # the knobs the grid varies, for short labels
    cluster: dict[str, Any] | None = None  # a cluster sweep: the description, knobs applied

    @property
    def key(self) -> str:
        """Canonical identity across runs (resume matches on it)."""
        body = {k: getattr(self, k) for k in SIM_KEYS} | {"engine": self.engine}
        if self.cluster is not None:
            body["cluster"] = self.cluster
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    def value(self, knob: str) -> Any:
        if knob.startswith(CLUSTER_KEY + "."):
            assert self.cluster is not None
            return _lookup(self.cluster, knob)
        return getattr(self, knob) if knob in SIM_KEYS else self.engine[knob]

    @property
    def label(self) -> str:
        knobs = self.varied or ("model", "hardware")
        return " ".join(f"{_short(k)}={_show(self.value(k))}" for k in knobs)

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_dict(self.engine, source="grid")


@dataclass(frozen=True)
class Grid:
    configs: list[SweepConfig]
    rate: RateSpec
    invalid: list[tuple[dict[str, Any], str]] = field(default_factory=list)  # combo, why
    varied: tuple[str, ...] = ()


def load_grid_file(path: str | Path) -> dict[str, list[Any] | Any]:
    """The raw mapping of a YAML or JSON grid file (YAML is a superset of JSON)."""
    import yaml

    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as e:
        raise ValueError(f"grid {p}: cannot read ({e.strerror})") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f":{where.line + 1}" if where is not None else ""
        raise ValueError(f"grid {p}{line}: not valid YAML/JSON") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"grid {p}: expected a mapping of knob names to lists of values")
    return raw


def build_grid(raw: Mapping[str, Any], source: str = "grid", base_dir: Path | None = None) -> Grid:
    """Validate `raw` (knob -> list or scalar) and expand it into configs. base_dir: where
    a `cluster` file named by a relative path lies (the grid file's folder)."""
    known = known_keys()
    cluster = _base_cluster(raw.get(CLUSTER_KEY), source, base_dir)
    for key in raw:
        if str(key).startswith(CLUSTER_KEY + "."):
            if cluster is None:
                raise ValueError(f"{source}: key {key!r}: no base cluster (add `cluster: FILE`)")
            continue
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"{source}: unknown key {key!r}{hint}")
    rate = parse_rate(raw.get(RATE_KEY), source)
    axes: dict[str, list[Any]] = {}
    for key, value in raw.items():
        if key in (RATE_KEY, CLUSTER_KEY):
            continue
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ValueError(f"{source}: key {key!r}: empty list")
        if key.startswith(CLUSTER_KEY + "."):
            assert cluster is not None
            _lookup(cluster, key, source, creating=True)  # an unknown path is named now
            axes[key] = list(values)
        else:
            axes[key] = [check_value(key, v, source) for v in values]
    varied = tuple(k for k, v in axes.items() if len(v) > 1)
    base = EngineConfig().to_dict()  # async_scheduling None: decided per config
    configs, invalid = [], []
    for combo in itertools.product(*axes.values()):
        chosen = dict(zip(axes, combo, strict=True))
        engine = base | {
            k: v for k, v in chosen.items() if k not in SIM_KEYS and not k.startswith("cluster.")
        }
        try:
            EngineConfig.from_dict(engine, source=source)
        except ValueError as e:  # a combination of valid values that does not go together
            invalid.append((chosen, str(e)))
            continue
        sim = DEFAULTS | {k: v for k, v in chosen.items() if k in SIM_KEYS}
        described = None
        if cluster is not None:
            described = _with_knobs(cluster, chosen)
            try:
                _check_cluster(described, engine, sim, source)
            except ValueError as e:
                invalid.append((chosen, str(e)))
                continue
        configs.append(SweepConfig(**sim, engine=engine, varied=varied, cluster=described))
    if not configs and not invalid:
        raise ValueError(f"{source}: the grid has no config")
    return Grid(configs, rate, invalid, varied)


def check_value(key: str, value: Any, source: str) -> Any:
    """`value` as the type `key` takes; a ValueError names the key otherwise."""
    if key in ("model", "hardware"):
        _check_preset(key, value, source)
        return value
    if key == "cost_model":
        if value is not None and value not in ("profiled", "analytic", "unit"):
            raise ValueError(f"{source}: key 'cost_model': {value!r} is not profiled|analytic|unit")
        return value
    if key == "acceptance_rate":
        v = _typed(key, value, float, source)
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{source}: key 'acceptance_rate': {v} is not in [0, 1]")
        return v
    default = getattr(EngineConfig(), key)
    if key in _OPTIONAL_INT and value is None:
        return None
    kind = int if key in _OPTIONAL_INT else type(default)
    if hasattr(default, "value"):  # an enum (role): its string value
        kind = str
    v = _typed(key, value, kind, source)
    try:  # the field's own range checks, one knob at a time
        EngineConfig.from_dict({key: v}, source=source)
    except ValueError as e:
        raise ValueError(f"{source}: key {key!r}: {e}") from None
    return v


def parse_rate(value: Any, source: str) -> RateSpec:
    if value is None:
        return RateSpec()
    if isinstance(value, list | tuple):
        rates = tuple(_typed(RATE_KEY, v, float, source) for v in value)
        if not rates or any(not r > 0 for r in rates):
            raise ValueError(f"{source}: key 'rate': fixed rates must be positive numbers")
        return RateSpec(rates=tuple(sorted(set(rates))))
    if not isinstance(value, dict):
        raise ValueError(f"{source}: key 'rate': expected a list of rates or a mapping of bounds")
    names = [f.name for f in dataclasses.fields(RateSpec) if f.name != "rates"]
    for k in value:
        if k not in names:
            raise ValueError(f"{source}: key 'rate.{k}': unknown; known: {names}")
    kinds = {"max_points": int}
    got: dict[str, Any] = {
        k: None
        if v is None and k == "start"
        else _typed(f"rate.{k}", v, kinds.get(k, float), source)
        for k, v in value.items()
    }
    spec = RateSpec(**got)
    if not 0 < spec.min < spec.max:
        raise ValueError(f"{source}: key 'rate': need 0 < rate.min < rate.max")
    if spec.start is not None and not spec.min <= spec.start <= spec.max:
        raise ValueError(f"{source}: key 'rate.start': must lie in [rate.min, rate.max]")
    if not 0 < spec.rel_tol < 1:
        raise ValueError(f"{source}: key 'rate.rel_tol': must be in (0, 1)")
    if spec.max_points < 2:
        raise ValueError(f"{source}: key 'rate.max_points': must be >= 2")
    return spec


def _typed(key: str, value: Any, kind: type, source: str) -> Any:
    """YAML gives typed values and flags give strings: accept both, exactly."""
    if isinstance(value, str) and kind is not str:
        value = _from_text(value, kind)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is float:  # an int is a fine float; a bool is not a number here
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{source}: key {key!r}: {value!r} is not {kind.__name__}")
    return float(value) if kind is float else value


def _from_text(text: str, kind: type) -> Any:
    low = text.strip().lower()
    if kind is bool:
        truth = {"1": True, "true": True, "yes": True, "on": True}
        return truth.get(low, False if low in ("0", "false", "no", "off") else text)
    try:
        return kind(low)
    except ValueError:
        return text


def _check_preset(key: str, value: Any, source: str) -> None:
    from deepinfer.model_config import load_model_config
    from sim.hardware import get_hardware

    if not isinstance(value, str):
        raise ValueError(f"{source}: key {key!r}: {value!r} is not a name")
    try:
        (load_model_config if key == "model" else get_hardware)(value)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ValueError(f"{source}: key {key!r}: {e}") from None


def _show(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


def _base_cluster(value: Any, source: str, base_dir: Path | None) -> dict[str, Any] | None:
    """The base cluster description: a file (YAML/JSON) or an inline mapping."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return copy.deepcopy(dict(value))
    if not isinstance(value, str):
        raise ValueError(f"{source}: key 'cluster': expected a cluster file or a mapping")
    import yaml

    path = Path(value)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"{source}: key 'cluster': cannot read {path} ({e.strerror})") from None
    except yaml.YAMLError:
        raise ValueError(f"{source}: key 'cluster': {path} is not YAML/JSON") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: key 'cluster': {path} is not a mapping")
    return raw


def _lookup(
    cluster: dict[str, Any], knob: str, source: str = "grid", *, creating: bool = False
) -> Any:
    """The value at a `cluster.a.b` path (pools addressed by name). creating: only check
    the path as far as it exists (a new key is set later, and the description's own
    checks name it if it is wrong)."""
    node: Any = cluster
    parts = knob.split(".")[1:]
    for i, part in enumerate(parts):
        if isinstance(node, list):  # the pools, by name
            found = [p for p in node if isinstance(p, dict) and p.get("name") == part]
            if not found:
                names = [p.get("name") for p in node if isinstance(p, dict)]
                raise ValueError(f"{source}: key {knob!r}: no pool named {part!r} ({names})")
            node = found[0]
            continue
        if not isinstance(node, dict):
            raise ValueError(f"{source}: key {knob!r}: {'.'.join(parts[:i])} is not a mapping")
        if part not in node:
            if creating:
                return None
            raise ValueError(f"{source}: key {knob!r}: the cluster has no {part!r}")
        node = node[part]
    return node


def _with_knobs(cluster: dict[str, Any], chosen: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the base cluster with this combination's `cluster.*` values set."""
    out = copy.deepcopy(cluster)
    for knob, value in chosen.items():
        if not knob.startswith(CLUSTER_KEY + "."):
            continue
        node: Any = out
        parts = knob.split(".")[1:]
        for part in parts[:-1]:
            if isinstance(node, list):
                node = next(p for p in node if p.get("name") == part)
            else:
                node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def _check_cluster(
    described: dict[str, Any], engine: dict[str, Any], sim: dict[str, Any], source: str
) -> None:
    from sim.cluster.description import cluster_from_dict

    cluster_from_dict(
        described,
        source=f"{source}: cluster",
        base_engine=EngineConfig.from_dict(engine, source=source),
        hardware=sim["hardware"],
        model=sim["model"],
    )


def _short(knob: str) -> str:
    """A cluster knob as a label shows it: `cluster.pools.decode.count` -> `decode.count`."""
    return knob.removeprefix(CLUSTER_KEY + ".").removeprefix("pools.")
