"""BlockPool + KVCacheManager against a reference model, as a hypothesis state machine.

The model is plain Python: each request's block table, the free blocks in
predicted eviction order (a freed uncached block goes to the front, a freed
cached one to the back, tail first), and mirror.PrefixModel, the exact-prefix
dict. Every allocation must return exactly the blocks the model predicts (hits,
then the front of the free order), or None exactly when the model runs out.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deepinfer.kv_cache.manager import KVCacheManager, cdiv
from deepinfer.request import Request
from tests.property.mirror import PrefixModel
from tests.property.strategies import scaled


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(bs=st.integers(1, 6), n=st.integers(1, 16), caching=st.booleans())
    def setup(self, bs: int, n: int, caching: bool) -> None:
        self.bs, self.n, self.caching = bs, n, caching
        self.kv = KVCacheManager(n, bs, caching)
        self.tables: dict[str, list[int]] = {}
        self.free = list(range(n))  # predicted eviction order, next victim first
        self.model = PrefixModel(bs, caching)
        self.reqs: dict[str, Request] = {}
        self.count = 0

    def _take(self, rid: str, got: list | None, hits: list[int], need: int) -> bool:
        """Check an allocation against the model and apply it; False if it was refused."""
        available = len(self.free) - sum(1 for b in hits if b in self.free)
        if need > available:
            assert got is None, f"allocated {need} blocks with {available} available"
            return False
        assert got is not None, f"refused {need} blocks with {available} available"
        self.free = [b for b in self.free if b not in hits]
        fresh, self.free = self.free[:need], self.free[need:]
        assert [b.block_id for b in got] == hits + fresh, "not the predicted blocks"
        for b in fresh:
            self.model.evict(b)
        self.tables.setdefault(rid, []).extend(hits + fresh)
        return True

    def _tokens(self, rid: str) -> list[int]:
        req = self.reqs[rid]
        return list(req.prompt) + req.output_token_ids

    @rule(
        chunks=st.lists(st.integers(0, 2), max_size=3),
        tail=st.lists(st.integers(0, 3), max_size=8),
        data=st.data(),
        reserve=st.booleans(),
        salt=st.sampled_from([None, None, "s"]),
    )
    def admit(
        self,
        chunks: list[int],
        tail: list[int],
        data: st.DataObject,
        reserve: bool,
        salt: str | None,
    ) -> None:
        """A new request: prefix lookup, then its first chunk (optionally reserving all).
        A cache salt keeps it from sharing blocks with requests of another salt."""
        tokens = [100 * c + j for c in chunks for j in range(self.bs)] + tail
        if not tokens:
            return
        rid = f"q{self.count}"
        self.count += 1
        req = self.reqs[rid] = Request(rid, tokens, cache_salt=salt)
        self.model.salts[rid] = salt
        hits = [b.block_id for b in self.kv.find_cached_prefix(req)]
        assert hits == self.model.lookup(rid, tokens), "hits differ from the reference dict"
        start = len(hits) * self.bs
        num_new = data.draw(st.integers(1, len(tokens) - start))
        want = max(start + num_new, len(tokens) if reserve else 0)
        got = self.kv.allocate(
            req,
            num_new,
            [self.kv.pool.blocks[b] for b in hits],
            reserve_tokens=want if reserve else 0,
        )
        if not self._take(rid, got, hits, max(cdiv(want, self.bs) - len(hits), 0)):
            del self.reqs[rid]
            return
        req.num_computed_tokens = start + num_new
        self.model.reg_upto[rid] = len(hits)
        self.model.register(rid, self.tables[rid], tokens, req.num_computed_tokens // self.bs)

    @precondition(lambda self: self.reqs)
    @rule(
        pick=st.integers(0, 99),
        size=st.integers(1, 8),
        token=st.integers(0, 3),
        lookahead=st.sampled_from([0, 0, 1, 2]),
    )
    def compute(self, pick: int, size: int, token: int, lookahead: int) -> None:
        """A step of a live request: sample a token if it is caught up, compute more,
        with `lookahead` slots past them (the MTP drafter's; `trim` gives them back)."""
        rid = sorted(self.reqs)[pick % len(self.reqs)]
        req = self.reqs[rid]
        if req.num_computed_tokens >= req.num_tokens:
            req.output_token_ids.append(token)
            self.kv.cache_computed(req)
            self.model.register(
                rid,
                self.tables[rid],
                self._tokens(rid),
                min(req.num_computed_tokens, req.num_tokens) // self.bs,
            )
        num_new = min(size, req.num_tokens - req.num_computed_tokens)
        end = req.num_computed_tokens + num_new + lookahead
        need = max(cdiv(end, self.bs) - len(self.tables[rid]), 0)
        got = self.kv.allocate(req, num_new, num_lookahead_tokens=lookahead)
        if self._take(rid, got, [], need):
            req.num_computed_tokens += num_new
            self.model.register(
                rid,
                self.tables[rid],
                self._tokens(rid),
                min(req.num_computed_tokens, req.num_tokens) // self.bs,
            )

    def _release(self, blocks: list[int]) -> None:
        held = {b for t in self.tables.values() for b in t}
        for b in reversed(blocks):
            if b not in held:
                if b in self.model.owner:
                    self.free.append(b)  # cached: evicted last
                else:
                    self.free.insert(0, b)  # nothing of value: reused first

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 99))
    def trim(self, pick: int) -> None:
        """Give back blocks reserved past the request's tokens (never registered ones):
        a reserved prompt's, or lookahead slots'."""
        rid = sorted(self.reqs)[pick % len(self.reqs)]
        req, table = self.reqs[rid], self.tables[rid]
        keep = max(cdiv(req.num_tokens, self.bs), self.model.reg_upto.get(rid, 0))
        self.kv.trim(req, req.num_tokens)
        surplus, self.tables[rid] = table[keep:], table[:keep]
        self._release(surplus)

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 99))
    def free(self, pick: int) -> None:
        rid = sorted(self.reqs)[pick % len(self.reqs)]
        self.kv.free(self.reqs.pop(rid))
        self._release(self.tables.pop(rid))
        self.model.reg_upto.pop(rid, None)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.kv.pool.reset_prefix_cache()
        for b in self.free:
            self.model.evict(b)

    @invariant()
    def matches_the_model(self) -> None:
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants()
        # Nothing is kept of a request once it holds no blocks (else the state grows).
        assert set(self.kv._num_cached) == set(self.kv.req_blocks), "state of a freed request"
        pool, held = self.kv.pool, [b for t in self.tables.values() for b in t]
        assert pool.num_free_blocks == len(self.free) == self.n - len(set(held))
        assert {rid: self.kv.block_ids(rid) for rid in self.kv.req_blocks} == self.tables
        for block in pool.blocks:
            assert block.ref_cnt == held.count(block.block_id), f"{block}"
            registered = block.block_id in self.model.owner
            assert (block.block_hash is not None) == registered, f"{block} cache state"
            if registered:
                assert pool.lookup(block.block_hash) is block  # type: ignore[arg-type]


# The profile's count, not a multiple: an example runs 50 rules, its time mostly
# hypothesis drawing them. At least 30 under the mutation profile (its 10 would leave the
# machine's rarer interleavings unreached).
KVCacheMachine.TestCase.settings = scaled(1.0, floor=30)
test_block_pool_and_kv_manager_match_the_reference_model = KVCacheMachine.TestCase
