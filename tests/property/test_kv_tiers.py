"""KV blocks are conserved across the tiers below HBM (deepinfer/kv_cache/tiers.py), and
the work the tiers allow is done, over random requests sharing prefixes, random HBM,
host and store sizes:

- a cached block leaves every place (HBM's index, the host tier, the store) only when
  the last tier drops one (a demotion moves it down, a load copies it up);
- a block a request holds keeps its content findable in HBM (never lost while held);
- a tier never holds more than its capacity, and each hash is in HBM's index once;
- a request's prefix past its HBM hits that a lower tier holds is loaded, not computed:
  exactly the blocks in host or store, up to the first in none (or back in HBM), and the
  loads land in the request's first fresh blocks, cached there under their hashes;
- the copies an executor makes of them (`kv_saves`, `kv_loads`, by the core's rule
  `step_copies`, which executors/host_kv_tier.py performs) move the right KV: a save copies an HBM block holding its
  hash, and a load of the first tier reads a slot holding its hash (as the steps before
  left it, or as this step's save of that hash to it does).
"""

from __future__ import annotations

from hypothesis import event, given
from hypothesis import strategies as st

from deepinfer.engine import EngineCore
from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.kv_cache.tiers import HBM, HOST, STORE, KVTiers, TierLRU, step_copies
from deepinfer.outputs import KVLoad, KVSave, SchedulerOutput
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from sim.sim_executor import SimExecutor
from tests.factories import StepClock, make_config
from tests.property.strategies import scaled

# An op: ("start", prefix chunks, own tail tokens, held on, joins the step before) or
# ("end", [], which live request, False, False). A request not held on ends with its step:
# its blocks stay cached, free.
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("start"),
            st.lists(st.integers(0, 5), min_size=0, max_size=3),
            st.integers(1, 5),
            st.booleans(),
            st.booleans(),
        ),
        st.tuples(st.just("end"), st.just([]), st.integers(0, 7), st.just(False), st.just(False)),
    ),
    min_size=8,
    max_size=40,
)


def _places(kv: KVCacheManager) -> set[int]:
    held = set(kv.pool._cached)
    tiers = kv.tiers
    assert tiers is not None
    for tier in tiers.order:
        held.update(tier.hashes())
    return held


@scaled(1.0)
@given(
    bs=st.integers(1, 4),
    num_blocks=st.integers(4, 14),
    host=st.integers(0, 6),
    store=st.integers(0, 6),
    script=ops,
)
def test_tier_blocks_are_conserved_and_loaded(
    bs: int,
    num_blocks: int,
    host: int,
    store: int,
    script: list[tuple[str, list[int], int, bool, bool]],
) -> None:
    if not host and not store:
        store = 3
    tiers = KVTiers(TierLRU(HOST, host) if host else None, TierLRU(STORE, store) if store else None)
    kv = KVCacheManager(num_blocks, bs, True, tiers)
    live: list[Request] = []
    # What an executor's copies leave: the hash whose KV each HBM block holds, and each
    # slot of the first tier.
    hbm: dict[int, int] = {}
    slots: dict[int, int] = {}
    step = _Step()
    for n, (op, chunks, tail, held, joins) in enumerate(script):
        if not joins:
            step.end(tiers.order[0].name, kv, hbm, slots)
        before, dropped = _places(kv), tiers.dropped
        if op == "end":
            if live:
                kv.free(live.pop(tail % len(live)))
        else:
            # Prefix chunks of 2 blocks each, shared by id; then a private tail.
            prompt = [t for c in chunks for t in range(1000 * (c + 1), 1000 * (c + 1) + 2 * bs)]
            prompt += [10**6 + 100 * n + i for i in range(tail)]
            req = Request(f"r{n}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
            hits = kv.find_cached_prefix(req)
            loads = kv.find_tier_hits(req, len(hits))
            # The oracle: past the HBM hits, every block in host or store, up to the first
            # in neither (or back in HBM).
            expected = 0
            for h in req.block_hashes[len(hits) : (req.num_tokens - 1) // bs]:
                if kv.pool.lookup(h) is not None or not any(h in t for t in tiers.order):
                    break
                expected += 1
            assert len(loads) == expected
            if loads:
                event("a prefix loaded from a lower tier")
            computed = (len(hits) + len(loads)) * bs
            got = kv.allocate(req, req.num_tokens - computed, hits, loads=loads)
            if got is None:
                assert kv.take_loads() == [] and kv.take_saves() == []
                assert _places(kv) == before  # refused: nothing moved
                continue
            req.num_computed_tokens = req.num_tokens
            taken = kv.take_loads()
            table = kv.req_blocks[req.request_id]
            step.loads += taken
            step.saves += kv.take_saves()
            # The blocks the step's forward writes (computed) or finds (hits, loads).
            step.written += [
                (block.block_id, req.block_hashes[i])
                for i, block in enumerate(table[: req.num_tokens // bs])
            ]
            assert [x.block_id for x in taken] == [
                b.block_id for b in table[len(hits) : len(hits) + len(loads)]
            ]
            for x, (h, tier) in zip(taken, loads):
                assert x.block_hash == h and x.tier == tier.name
                assert kv.pool.lookup(h) is not None
            if held:
                live.append(req)
            else:
                step.ending.append(req)
        kv.check_invariants()  # (each tier within its capacity, HBM's index consistent)
        vanished = before - _places(kv)
        assert len(vanished) <= tiers.dropped - dropped, vanished
        for req in live:  # held blocks stay findable
            for i, h in enumerate(req.block_hashes[: req.num_tokens // bs]):
                block = kv.pool.lookup(h)
                assert block is not None and block is kv.req_blocks[req.request_id][i]
    step.end(tiers.order[0].name, kv, hbm, slots)


class _Step:
    """The starts of one step: their copies, taken together at its end as an executor
    makes them, the blocks its forward writes, and the requests that end with it."""

    def __init__(self) -> None:
        self.loads: list[KVLoad] = []
        self.saves: list[KVSave] = []
        self.written: list[tuple[int, int]] = []  # (HBM block, the hash it then holds)
        self.ending: list[Request] = []

    def _clear(self) -> None:
        self.loads, self.saves, self.written, self.ending = [], [], [], []

    def end(
        self, first: str, kv: KVCacheManager, hbm: dict[int, int], slots: dict[int, int]
    ) -> None:
        if self.loads or self.saves:
            sources = step_copies(self.loads, self.saves).sources
            if any(j is not None for j in sources):
                event("a load reads a save of its own step")
        _copy(first, self.loads, self.saves, hbm, slots)
        for block_id, h in self.written:
            hbm[block_id] = h
        for req in self.ending:
            kv.free(req)
        self._clear()


def _copy(
    first: str, loads: list[KVLoad], saves: list[KVSave], hbm: dict[int, int], slots: dict[int, int]
) -> None:
    """One step's copies by the core's rule (`step_copies`, which the executor performs and
    the simulator prices), checking that each moves its hash's KV."""
    copies = step_copies(loads, saves)
    for x in saves:
        assert x.tier == first and hbm.get(x.block_id) == x.block_hash, x
    for x, j in zip(loads, copies.sources):
        if j is not None:  # read from this step's save: the same block, as the step found it
            assert saves[j].block_hash == x.block_hash and saves[j].slot == x.slot, x
        elif x.tier == first:  # (host to store moves are bookkeeping: nothing copies them)
            assert slots.get(x.slot) == x.block_hash, x
    for j in copies.written:
        slots[saves[j].slot] = saves[j].block_hash
    for x in loads:
        hbm[x.block_id] = x.block_hash


def _one_at_a_time(
    role: str, requests: list[tuple[str, tuple[int, ...], int, int | None]]
) -> tuple[EngineCore, dict[str, Request], dict[str, SchedulerOutput]]:
    """Each of `requests` (id, prompt, max_tokens, prompt logprobs) run alone, in turn,
    on a 4-block HBM of 4-token blocks over an 8-block host tier; returns the engine, the
    requests and the step that started each."""
    cfg = make_config(block_size=4, num_gpu_blocks=4, max_num_seqs=1, role=role,
                      max_num_batched_tokens=16, enable_prefix_caching=True)  # fmt: skip
    engine = EngineCore(cfg, SimExecutor(cfg, 4), clock=StepClock(),
                        kv_tiers=KVTiers(TierLRU(HOST, 8)))  # fmt: skip
    starts: dict[str, SchedulerOutput] = {}
    schedule = engine.scheduler.schedule

    def recorded() -> SchedulerOutput:
        out = schedule()
        starts.update((sr.req_id, out) for sr in out.scheduled if sr.block_table is not None)
        return out

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    reqs: dict[str, Request] = {}
    for rid, prompt, max_tokens, logprobs in requests:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=logprobs)
        reqs[rid] = Request(rid, list(prompt), sp)
        assert engine.add_request(reqs[rid]) is None
        while engine.has_unfinished():
            engine.step()
    return engine, reqs, starts


def test_a_start_loads_its_prefix_from_the_host_tier_unless_it_wants_prompt_logprobs() -> None:
    """The scheduler's side of the loads (docs/design.md: a starting request takes exactly
    the prefix hit the cache holds for it, none when it asks for prompt logprobs): a start
    counts the blocks it loads from a lower tier as computed, cached (the request's cached
    tokens, the executor's blocks with content) and hit, and computes only the rest, at
    least its last token; one that asks for prompt logprobs loads nothing and computes
    its whole prompt, and its start is no prefix lookup (hits by tier count only starts
    that take hits; HBM lookups count every prompt looked up and the tokens hit).

    Pinned (`_one_at_a_time`): `a` (9 tokens, two full blocks) runs; `b` (13 tokens)
    evicts both of its full blocks into the host tier; `d` asks for `a`'s prompt with
    prompt logprobs; `b2` evicts them again; `c` asks for `a`'s prompt and loads both;
    `b3` evicts them again; `g`, `a`'s first 8 tokens, loads one (its last token is
    computed); `e` and `f` hit both in HBM. (Kills `Scheduler._start__mutmut_15`, `d`'s
    start counted as a lookup; `_28`, `_78`, `_95`, the loads subtracted from `c`'s hit,
    and `_94`, `_56`, its cached blocks or loads not passed on; `KVCacheManager.__init__`
    `_23` to `_33`, counters not from 0; `find_cached_prefix` `_17` to `_21`, counters
    not summed; `find_tier_hits` `_4` to `_7`, `g`'s limit.)"""
    a = tuple(range(1, 10))
    engine, reqs, starts = _one_at_a_time(
        "normal",
        [("a", a, 1, None), ("b", tuple(range(100, 113)), 1, None), ("d", a, 1, 1),
         ("b2", tuple(range(200, 213)), 1, None), ("c", a, 1, None),
         ("b3", tuple(range(300, 313)), 1, None), ("g", a[:8], 1, None),
         ("e", a, 1, None), ("f", a, 1, None)],
    )  # fmt: skip
    assert len(starts["b"].kv_saves) == 2, "pinned: b evicts a's two full blocks to the host"
    (d,) = starts["d"].scheduled
    assert (d.num_computed_tokens, d.num_tokens, starts["d"].kv_loads) == (0, 9, ()), d
    (c,) = starts["c"].scheduled
    loads = starts["c"].kv_loads
    assert [ld.block_id for ld in loads] == (c.block_table or [])[:2], (loads, c)
    assert (c.num_computed_tokens, c.num_tokens, len(c.block_table or [])) == (8, 1, 3), c
    assert (c.num_cached_blocks, reqs["c"].num_cached_tokens) == (2, 8), c
    (g,) = starts["g"].scheduled
    assert (g.num_computed_tokens, g.num_tokens, len(starts["g"].kv_loads)) == (4, 4, 1), g
    for rid in "ef":
        (sr,) = starts[rid].scheduled
        assert (sr.num_computed_tokens, sr.num_tokens, starts[rid].kv_loads) == (8, 1, ()), sr
    kv = engine.scheduler.kv
    looked_up = 2 + 3 + 3 + 2 + 3 + 1 + 2 + 2  # (n - 1) // 4 blocks a start, d's none
    assert kv.num_prefix_blocks_looked_up == looked_up, "d's start is no lookup"
    assert kv.prefix_hit_blocks == {HBM: 2 + 2, HOST: 2 + 1, STORE: 0}
    # HBM lookups: every prompt but d's; e and f hit two blocks each
    assert (kv.num_lookup_tokens, kv.num_hit_tokens) == (9 + 13 + 13 + 9 + 13 + 8 + 9 + 9, 16)


def test_a_decode_engine_loads_nothing_for_a_prompt_whose_kv_arrives() -> None:
    """A decode engine's request brings its prompt's KV (docs/design.md, "Roles"): the
    blocks past its own HBM hits are filled from that KV, so a lower tier holding its
    prefix is not read, and its start is no prefix lookup.

    Pinned (`_one_at_a_time`, role decode): `a` (9 tokens) decodes until its prompt's
    blocks are cached; `b` (13 tokens) evicts them into the host tier; `c` brings `a`'s
    prompt. (Kills `Scheduler._start__mutmut_19`: `c` loads the host's copies.)"""
    a = tuple(range(1, 10))
    engine, reqs, starts = _one_at_a_time(
        "decode", [("a", a, 4, None), ("b", tuple(range(100, 113)), 1, None), ("c", a, 1, None)]
    )
    assert len(starts["b"].kv_saves) == 3, "pinned: b evicts a's three blocks to the host"
    (c,) = starts["c"].scheduled
    assert (c.num_computed_tokens, c.num_cached_blocks, starts["c"].kv_loads) == (8, 0, ()), c
    assert reqs["c"].num_cached_tokens == 0, "the KV brought is no cache hit"
    kv = engine.scheduler.kv
    assert (kv.num_prefix_blocks_looked_up, kv.prefix_hit_blocks[HOST]) == (0, 0)
