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
the one strictly most loaded of all), and a twin router of the same seed, fed the same
calls, must choose alike.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    rule,
    run_state_machine_as_test,
)

from deepinfer.kv_cache.hashing import update_block_hashes
from deepinfer.request import Request
from deepinfer.routing import ROUTERS, InstanceLoad, make_router
from deepinfer.routing.instance_report import InstanceReport, take_report
from deepinfer.routing.instance_view import views_of
from deepinfer.routing.policies import SEEDED
from deepinfer.sampling_params import SamplingParams
from tests.property.harness import note
from tests.property.strategies import scaled

BS = 4  # tokens per block
CHUNKS = 4  # distinct shared blocks prompts are built from


def _tokens(chunks: tuple[int, ...], tail: int = 0) -> tuple[int, ...]:
    """Whole blocks of the shared chunks, then `tail` tokens no other prompt has."""
    out = [c * 100 + j + 1 for c in chunks for j in range(BS)]
    return tuple(out + [10_000 + j for j in range(tail)])


def _request(req_id: str, tokens: tuple[int, ...]) -> Request:
    return Request(req_id, list(tokens), SamplingParams(max_tokens=4, ignore_eos=True))


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

    def allowed(self, tokens: tuple[int, ...]) -> list[int]:
        """The eligible instances the policy's rule allows, lowest index first; for the
        deterministic policies the choice must be the first."""
        el = self.eligible(tokens)
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
        imbalance=st.integers(0, 2),
    )
    def setup(self, limits: list[int], seed: int, imbalance: int) -> None:
        policy = self.policy
        options = {"max_imbalance": imbalance} if policy == "prefix-affinity" else {}
        n = len(limits)
        self.router = make_router(policy, n, seed=seed, **options)
        self.twin = make_router(policy, n, seed=seed, **options) if policy in SEEDED else None
        self.views = views_of(BS, limits)
        self.twin_views = views_of(BS, limits)
        self.model = RouterModel(policy, limits, imbalance)
        self.prefixes: dict[int, tuple[int, ...]] = {}  # reported hash -> its exact prefix
        self.count = 0

    @rule(chunks=_CHUNK_IDS, tail=st.integers(0, 6), burst=st.integers(1, 3))
    def route(self, chunks: tuple[int, ...], tail: int, burst: int) -> None:
        tokens = _tokens(chunks, tail) or (1,)
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
        settings=settings(scaled(0.12), stateful_step_count=40, deadline=None),
    )
