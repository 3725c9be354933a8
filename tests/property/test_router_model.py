"""Every routing policy against a reference model of its rule (docs/design.md, "Clusters"),
as a hypothesis state machine.

The model restates each policy from the specification and keeps its own log, never the
router's bookkeeping: which live requests it placed on each instance (outstanding =
placed and not reported ended), each instance's last reported load and the placements
since that report, and the prefixes each instance reported cached, as exact token
tuples (the reports carry them as the engine's chain hashes). At each placement it
computes the instances the rule allows: the eligible ones (the prompt fits their
`max_prompt_tokens`, or all when it fits none), the minimum of the policy's key among
them, ties to the lowest index. `power-of-two` draws at random: the model allows any
eligible instance that is the less loaded of some pair of eligible instances (never
the one strictly most loaded of all), and a twin built from its class with the same
seed (or none, for the default 0), fed the same calls, must choose alike.

Beside the choices, what the router and its views hold is checked against the log: the
outstanding counts, each view's last load and cached hashes, which requests fit it, and
how many leading blocks of each prompt it holds cached; options omitted take their
documented defaults (seed 0, max_imbalance 8); misuse is refused by name.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from deepinfer.kv_cache.hashing import update_block_hashes
from deepinfer.request import Request
from deepinfer.routing import ROUTERS, InstanceLoad, make_router
from deepinfer.routing.instance_report import InstanceReport, take_report
from deepinfer.routing.instance_view import InstanceView, views_of
from deepinfer.routing.policies import SEEDED, PrefixAffinityRouter
from deepinfer.routing.router import Router
from deepinfer.sampling_params import SamplingParams
from tests.property.harness import note
from tests.property.strategies import scaled

BS = 4  # tokens per block
DEFAULT_IMBALANCE = 8  # prefix-affinity's max_imbalance when none is given
CHUNKS = 4  # distinct shared blocks prompts are built from


def _tokens(chunks: tuple[int, ...], tail: int = 0) -> tuple[int, ...]:
    """Whole blocks of the shared chunks, then `tail` tokens no other prompt has."""
    out = [c * 100 + j + 1 for c in chunks for j in range(BS)]
    return tuple(out + [10_000 + j for j in range(tail)])


def _request(req_id: str, tokens: tuple[int, ...]) -> Request:
    return Request(req_id, list(tokens), SamplingParams(max_tokens=4, ignore_eos=True))


@functools.cache
def _chain_hash(prefix: tuple[int, ...]) -> int:
    """The hash an engine reports for the last block of `prefix` (whole blocks)."""
    return update_block_hashes(_request("hash", prefix), BS)[-1]


class RouterModel:
    """A policy's rule over the model's own log (see the module docstring)."""

    def __init__(self, policy: str, limits: list[int], max_imbalance: int) -> None:
        self.policy, self.limits, self.max_imbalance = policy, limits, max_imbalance
        n = len(limits)
        self.live: list[set[str]] = [set() for _ in range(n)]  # placed, not reported ended
        self.loads = [InstanceLoad() for _ in range(n)]
        self.placed_since = [0] * n  # placements since the instance's last report
        self.cached: list[set[tuple[int, ...]]] = [set() for _ in range(n)]
        self.last_rr: int | None = None  # round-robin: the instance chosen last

    def out(self, i: int) -> int:
        return len(self.live[i])

    def hit(self, i: int, tokens: tuple[int, ...]) -> int:
        """Leading whole blocks of the prompt instance `i` reported cached."""
        b = 0
        while (b + 1) * BS <= len(tokens) and tokens[: (b + 1) * BS] in self.cached[i]:
            b += 1
        return b

    def eligible(self, tokens: tuple[int, ...]) -> list[int]:
        fits = [i for i, m in enumerate(self.limits) if len(tokens) <= m]
        if not fits:
            note("a prompt no instance admits: every instance eligible")
        return fits or list(range(len(self.limits)))

    def allowed(self, tokens: tuple[int, ...], el: list[int] | None = None) -> list[int]:
        """The eligible instances (`el`, if given) the policy's rule allows, lowest index
        first; for the deterministic policies the choice must be the first."""
        el = self.eligible(tokens) if el is None else el
        key: Callable[[int], tuple[float, ...]]
        if self.policy == "round-robin":  # the next eligible one after the last, cyclically
            start = 0 if self.last_rr is None else self.last_rr + 1
            n = len(self.limits)
            return [min(el, key=lambda i: (i - start) % n)]
        if self.policy == "least-requests":
            key = lambda i: (self.out(i),)  # noqa: E731
        elif self.policy == "least-kv":
            key = lambda i: (self.loads[i].kv_usage, self.out(i))  # noqa: E731
        elif self.policy == "least-load":
            key = lambda i: (  # noqa: E731
                self.loads[i].num_waiting + self.placed_since[i],
                self.loads[i].kv_usage,
                self.loads[i].num_running,
            )
        elif self.policy == "prefix-affinity":
            return [self._affinity(tokens, el)]
        elif self.policy == "power-of-two":
            if len(el) == 1:
                return el
            top = max(el, key=lambda i: (self.out(i), i))  # never the less loaded of a pair
            return [i for i in el if i != top]
        else:
            raise AssertionError(f"no model of policy {self.policy!r}")
        best = min(key(i) for i in el)
        tied = [i for i in el if key(i) == best]
        if len(tied) > 1:
            note(f"{self.policy}: a tie went to the lowest index")
        return tied

    def _affinity(self, tokens: tuple[int, ...], el: list[int]) -> int:
        least = min(el, key=lambda i: (self.out(i), i))
        hits = {i: self.hit(i, tokens) for i in el}
        best = min(el, key=lambda i: (-hits[i], self.out(i), i))
        if hits[best] == 0:
            return least
        if self.out(best) > self.out(least) + self.max_imbalance:
            note("prefix-affinity: the imbalance overrode a hit")
            return least
        note("prefix-affinity: placed on a prefix hit")
        return best

    def placed(self, req_id: str, tokens: tuple[int, ...], chosen: int) -> None:
        allowed = self.allowed(tokens)
        state = [
            (i, self.out(i), self.loads[i], self.placed_since[i], self.hit(i, tokens), m)
            for i, m in enumerate(self.limits)
        ]
        where = f"{self.policy}: {req_id} ({len(tokens)} tokens) placed on {chosen}"
        assert chosen in allowed, f"{where}; the rule allows {allowed}: {state}"
        if self.policy != "power-of-two":
            assert chosen == allowed[0], f"{where}, not the lowest of {allowed}: {state}"
        self.live[chosen].add(req_id)
        self.placed_since[chosen] += 1
        self.last_rr = chosen

    def report(self, r: InstanceReport, prefixes: dict[int, tuple[int, ...]]) -> None:
        self.loads[r.index] = r.load
        self.placed_since[r.index] = 0
        for h, now in r.cache_changes.items():
            (self.cached[r.index].add if now else self.cached[r.index].discard)(prefixes[h])
        self.live[r.index] -= set(r.finished)


_USAGE = st.sampled_from([0.0, 0.5]) | st.floats(0.0, 1.0)  # ties are common


def _chunk_ids(min_blocks: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Runs of consecutive chunks from one of two starts: prompts and reported prefixes
    share leading blocks often, so hits of every length happen."""
    runs = st.tuples(st.integers(0, 1), st.integers(min_blocks, CHUNKS))
    return runs.map(lambda r: tuple((r[0] + j) % CHUNKS for j in range(r[1])))


_CHUNK_IDS = _chunk_ids(0)
_NONEMPTY_CHUNK_IDS = _chunk_ids(1)


class RouterMachine(RuleBasedStateMachine):
    """Routes, reports (loads, cache changes, ended requests) and their interleavings
    over 1-4 instances of mixed admission limits, for one policy."""

    def __init__(self, policy: str) -> None:
        super().__init__()
        self.policy = policy

    @initialize(
        limits=st.lists(st.sampled_from([6, 14, 22]), min_size=1, max_size=4),
        seed=st.integers(0, 3),
        imbalance=st.sampled_from([0, 1, 0, 1, DEFAULT_IMBALANCE]),  # small ones override hits
    )
    def setup(self, limits: list[int], seed: int, imbalance: int) -> None:
        """Options at their defaults are omitted (seed 0, max_imbalance 8)."""
        policy = self.policy
        options: dict[str, int] = {}
        if policy == "prefix-affinity" and imbalance != DEFAULT_IMBALANCE:
            options["max_imbalance"] = imbalance
        seeded = {"seed": seed} if seed else {}
        n = len(limits)
        self.router = make_router(policy, n, **seeded, **options)
        # A twin of a seeded policy, built from its class: the same seed draws alike.
        self.twin = ROUTERS[policy](n, **seeded) if policy in SEEDED else None
        self.views = views_of(BS, limits)
        self.twin_views = views_of(BS, limits)
        self.model = RouterModel(policy, limits, imbalance)
        self.prefixes: dict[int, tuple[int, ...]] = {}  # reported hash -> its exact prefix
        self.count = 0
        if isinstance(self.router, PrefixAffinityRouter):
            assert self.router.max_imbalance == imbalance

    @rule(chunks=_CHUNK_IDS, tail=st.integers(0, 6), burst=st.integers(1, 3))
    def route(self, chunks: tuple[int, ...], tail: int, burst: int) -> None:
        tokens = _tokens(chunks, tail) or (1,)
        req = _request("probe", tokens)
        for view, limit in zip(self.views, self.model.limits):
            assert view.fits(req) == (len(tokens) <= limit), (view.index, len(tokens), limit)
            hit = self.model.hit(view.index, tokens)
            assert view.cached_prefix_blocks(req) == hit, (view.index, tokens, hit)
        for _ in range(burst):
            rid = f"r{self.count}"
            self.count += 1
            chosen = self.router.route(_request(rid, tokens), self.views)
            if self.twin is not None:
                again = self.twin.route(_request(rid, tokens), self.twin_views)
                assert again == chosen, f"same seed, same calls: {again} != {chosen} for {rid}"
            self.model.placed(rid, tokens, chosen)

    @rule(
        pick=st.integers(0, 3),
        waiting=st.integers(0, 2),
        running=st.integers(0, 3),
        usage=_USAGE,
        changes=st.lists(
            st.tuples(_NONEMPTY_CHUNK_IDS, st.booleans(), st.integers(1, CHUNKS)),
            min_size=1,
            max_size=2,
        ),
        ends=st.lists(st.integers(0, 20), max_size=3),
    )
    def report(
        self,
        pick: int,
        waiting: int,
        running: int,
        usage: float,
        changes: list[tuple[tuple[int, ...], bool, int]],
        ends: list[int],
    ) -> None:
        index = pick % len(self.views)
        cache = {}
        for chunks, now, at in changes:  # cached: the prefix's every block; evicted: one
            blocks = range(1, len(chunks) + 1) if now else [min(at, len(chunks))]
            for b in blocks:
                prefix = _tokens(chunks[:b])
                h = _chain_hash(prefix)
                self.prefixes[h] = prefix
                cache[h] = now
        live = sorted(self.model.live[index])
        finished = tuple(sorted({live[e % len(live)] for e in ends})) if live else ()
        r = InstanceReport(index, InstanceLoad(waiting, running, usage), cache, finished)
        take_report(self.router, self.views, r)
        if self.twin is not None:
            take_report(self.twin, self.twin_views, r)
        self.model.report(r, self.prefixes)

    @rule(chunks=_CHUNK_IDS, tail=st.integers(0, 6))
    def choose_within_pairs(self, chunks: tuple[int, ...], tail: int) -> None:
        """On copies of a deterministic router: a request that fits only instances a and
        b goes where the rule says among those two, for every pair (so the rule's whole
        order is checked, not only its first)."""
        if self.policy in SEEDED:
            return
        tokens = _tokens(chunks, tail) or (1,)
        n = len(tokens)
        for a, b in itertools.combinations(range(len(self.views)), 2):
            views = [
                dataclasses.replace(v, max_prompt_tokens=n if v.index in (a, b) else n - 1)
                for v in self.views
            ]
            chosen = copy.deepcopy(self.router).route(_request("pair", tokens), views)
            allowed = self.model.allowed(tokens, [a, b])
            assert chosen == allowed[0], f"{self.policy}: of {a} and {b}, {chosen} chosen"

    @rule(pick=st.integers(0, 3))
    def more_ends_than_placements(self, pick: int) -> None:
        """On a copy: an instance told of one more ended request than it has outstanding
        refuses it, naming the instance."""
        index = pick % len(self.views)
        router = copy.deepcopy(self.router)
        for k in range(self.model.out(index)):
            router.on_finished(f"ended{k}", index)
        with pytest.raises(RuntimeError, match=f"^instance {index}: more requests finished"):
            router.on_finished("ghost", index)

    @rule(extra=st.sampled_from([-1, 1]))
    def views_of_another_pool(self, extra: int) -> None:
        """A route given one view too few or too many is refused, naming both counts, and
        books nothing."""
        n = len(self.views)
        views = self.views[: n + extra] if extra < 0 else [*self.views, self.views[0]]
        with pytest.raises(ValueError, match=f"^{n + extra} views for a router of {n} inst"):
            self.router.route(_request("stray", (1,)), views)

    @invariant()
    def router_and_views_hold_the_log(self) -> None:
        if not hasattr(self, "model"):
            return
        model = self.model
        assert self.router.outstanding == [model.out(i) for i in range(len(self.views))]
        for i, view in enumerate(self.views):
            assert view.load == model.loads[i], (i, view.load, model.loads[i])
            assert view.cached == {_chain_hash(p) for p in model.cached[i]}, i

    @rule()
    def everything_ends(self) -> None:
        """Every instance reports idle with all its requests ended: the counts start over."""
        for i in range(len(self.views)):
            ended = tuple(sorted(self.model.live[i]))
            r = InstanceReport(i, InstanceLoad(), {}, ended)
            take_report(self.router, self.views, r)
            if self.twin is not None:
                take_report(self.twin, self.twin_views, r)
            self.model.report(r, self.prefixes)


@pytest.mark.parametrize("policy", sorted(ROUTERS))
def test_every_router_places_as_its_rule_says(policy: str) -> None:
    """Each policy, over random routes, reports and ends, chooses an instance its rule
    allows (the lowest-index one where the rule is deterministic)."""
    run_state_machine_as_test(
        lambda: RouterMachine(policy),
        settings=settings(scaled(0.12, floor=36), stateful_step_count=40, deadline=None),
    )


class _Stray(Router):
    """A policy that breaks the interface: it chooses the lowest index, eligible or not."""

    name = "stray"

    def choose(self, request: Request, instances: Sequence[InstanceView]) -> int:
        return 0


def test_misuse_is_refused_by_name() -> None:
    """Unknown policies and options, bad option values, an empty pool and a policy
    choosing an instance the request may not go to are refused, each naming what."""
    names = ", ".join(ROUTERS)
    with pytest.raises(ValueError, match=f"^router 'nope': expected one of {names}$"):
        make_router("nope", 2)
    for policy in ROUTERS:
        with pytest.raises(ValueError) as err:
            make_router(policy, 2, bogus=1)
        takes = "takes max_imbalance" if policy == "prefix-affinity" else "takes no options"
        assert str(err.value) == f"router {policy!r}: unknown option 'bogus' ({policy} {takes})"
    for bad in (1.5, True, "2"):
        with pytest.raises(ValueError, match=f"^max_imbalance={bad!r}: expected an integer$"):
            make_router("prefix-affinity", 2, max_imbalance=bad)
    with pytest.raises(ValueError, match=r"^max_imbalance=-1: must be >= 0$"):
        make_router("prefix-affinity", 2, max_imbalance=-1)
    assert make_router("prefix-affinity", 1, max_imbalance=0).max_imbalance == 0
    for policy in ROUTERS:
        with pytest.raises(ValueError, match="^num_instances=0: a router needs >= 1 instance$"):
            make_router(policy, 0)
    stray = _Stray(2)
    views = views_of(BS, [2, 100])  # a prompt of 5 tokens fits instance 1 only
    with pytest.raises(RuntimeError, match="^router 'stray' chose 0, not an eligible instance$"):
        stray.route(_request("r", (1, 2, 3, 4, 5)), views)
    assert stray.outstanding == [0, 0]
    assert stray.route(_request("r", (1, 2)), views) == 0  # fits both: 0 is eligible
    assert stray.outstanding == [1, 0]
