"""The sweep's grid: knob names mapped to lists of values, from a YAML/JSON file or flags.

Every combination of the listed values is one config (the cartesian product, in the
order the keys and values are given). Keys are the EngineConfig fields plus `model`,
`hardware`, `cost_model`, `acceptance_rate`, and `rate` (a list of fixed rates, or a
mapping of bisection bounds; see `RateSpec`). A bad key or value is a ValueError whose
one-line message names the key, so the CLI can print it and exit 2.
"""

from __future__ import annotations

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
DEFAULTS: dict[str, Any] = {
    "model": "moonlight-16b-a3b",
    "hardware": "h200",
    "cost_model": None,  # what simulate() picks: profiled where a profile exists, else analytic
    "acceptance_rate": 0.7,
}
# Fields that default to None ("derived") take an int when given.
_OPTIONAL_INT = ("num_gpu_blocks", "max_model_len")


def known_keys() -> list[str]:
    return [*EngineConfig.field_names(), *SIM_KEYS, RATE_KEY]


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

    @property
    def key(self) -> str:
        """Canonical identity across runs (resume matches on it)."""
        body = {k: getattr(self, k) for k in SIM_KEYS} | {"engine": self.engine}
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    def value(self, knob: str) -> Any:
        return getattr(self, knob) if knob in SIM_KEYS else self.engine[knob]

    @property
    def label(self) -> str:
        knobs = self.varied or ("model", "hardware")
        return " ".join(f"{k}={_show(self.value(k))}" for k in knobs)

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


def build_grid(raw: Mapping[str, Any], source: str = "grid") -> Grid:
    """Validate `raw` (knob -> list or scalar) and expand it into configs."""
    known = known_keys()
    for key in raw:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"{source}: unknown key {key!r}{hint}")
    rate = parse_rate(raw.get(RATE_KEY), source)
    axes: dict[str, list[Any]] = {}
    for key, value in raw.items():
        if key == RATE_KEY:
            continue
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ValueError(f"{source}: key {key!r}: empty list")
        axes[key] = [check_value(key, v, source) for v in values]
    varied = tuple(k for k, v in axes.items() if len(v) > 1)
    base = EngineConfig().to_dict()  # async_scheduling None: decided per config
    configs, invalid = [], []
    for combo in itertools.product(*axes.values()):
        chosen = dict(zip(axes, combo, strict=True))
        engine = base | {k: v for k, v in chosen.items() if k not in SIM_KEYS}
        try:
            EngineConfig.from_dict(engine, source=source)
        except ValueError as e:  # a combination of valid values that does not go together
            invalid.append((chosen, str(e)))
            continue
        sim = DEFAULTS | {k: v for k, v in chosen.items() if k in SIM_KEYS}
        configs.append(SweepConfig(**sim, engine=engine, varied=varied))
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
