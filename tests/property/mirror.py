"""KVMirror: the KV cache as the SchedulerOutputs describe it, kept by the test.

It rebuilds every block table from the outputs alone (a resumed request's
`block_table`, then `new_block_ids` appended; preempted and ended requests
dropped; draft-slot trims taken from the core after `process`), records the
token written into each block slot by each step, and keeps a plain-dict
reference model of the prefix cache: a prefix (exact token tuples, no hashing)
maps to the block registered for it; a block handed out fresh loses its entry.
It asserts that its tables equal the core's after every half step; the checkers
read its observations (admissions with the usage before them, predicted hits).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from tests.property.harness import Checker, Driver


@dataclass
class Admission:
    req_id: str
    held_before: int  # blocks held by any request just before this request's allocation
    hits: int  # leading blocks reused from the prefix cache (NORMAL/PREFILL: from the output)
    predicted: list[int]  # block ids the reference dict finds for its prefix
    table: list[int]  # its block table after the allocation
    num_tokens: int
    start: int  # tokens it starts with computed (the hit, or num_tokens - 1 if it imports)


class PrefixModel:
    """Prefix -> block, keyed by interned exact prefixes (no hashes)."""

    def __init__(self, block_size: int, enabled: bool) -> None:
        self.bs, self.enabled = block_size, enabled
        self._intern: dict[tuple[object, tuple[int, ...]], int] = {}
        self._pids: dict[str, list[int]] = {}  # req_id -> prefix id of each full block
        # req_id -> its cache salt: prefixes of different salts never match.
        self.salts: dict[str, str | None] = {}
        self.cache: dict[int, int] = {}  # prefix id -> block id
        self.owner: dict[int, int] = {}  # block id -> prefix id
        self.reg_upto: dict[str, int] = {}  # req_id -> leading blocks already considered

    def pids(self, req_id: str, tokens: list[int]) -> list[int]:
        out = self._pids.setdefault(req_id, [])
        root = ("root", self.salts.get(req_id))
        for i in range(len(out), len(tokens) // self.bs):
            start = i * self.bs
            block: tuple = tuple(tokens[start : start + self.bs])
            key = (out[-1] if out else root, block)
            out.append(self._intern.setdefault(key, len(self._intern)))
        return out

    def lookup(self, req_id: str, tokens: list[int]) -> list[int]:
        if not self.enabled:
            return []
        hits = []
        for pid in self.pids(req_id, tokens)[: (len(tokens) - 1) // self.bs]:
            if pid not in self.cache:
                break
            hits.append(self.cache[pid])
        return hits

    def register(self, req_id: str, table: list[int], tokens: list[int], num_full: int) -> None:
        """Register blocks [reg_upto, num_full) of the request, each position once."""
        if not self.enabled:
            return
        start = self.reg_upto.get(req_id, 0)
        pids = self.pids(req_id, tokens)
        for i in range(start, num_full):
            if pids[i] not in self.cache and table[i] not in self.owner:  # first one wins
                self.cache[pids[i]] = table[i]
                self.owner[table[i]] = pids[i]
        self.reg_upto[req_id] = max(start, num_full)

    def evict(self, block: int) -> None:
        pid = self.owner.pop(block, None)
        if pid is not None:
            del self.cache[pid]


class KVMirror(Checker):
    def __init__(self, d_case_block_size: int, num_blocks: int, caching: bool) -> None:
        self.bs, self.n = d_case_block_size, num_blocks
        self.tables: dict[str, list[int]] = {}
        self.gen = [0] * num_blocks  # bumped each time a block is handed out fresh
        self.content: list[dict[int, int]] = [{} for _ in range(num_blocks)]  # slot -> token
        self.pending: list[tuple[str, int, int, int]] = []  # (req, pos, block, gen): unknown yet
        self.comp: dict[str, int] = {}  # req_id -> tokens computed, per the outputs
        # (step, req) -> (table, draft start, start). Under async scheduling a step
        # scheduled before the previous one's drafts were verified assumed them all
        # accepted; once the rejections are known its positions shift back by that many.
        self.sched_info: dict[tuple[int, str], tuple[list[int], int, int]] = {}
        self.prefix = PrefixModel(d_case_block_size, caching)
        self.admissions: list[Admission] = []  # of the latest schedule() call
        self.before: dict[str, list[int]] = {}  # the tables just before that call
        self.hit_mismatches: list[str] = []  # content or prediction disagreements seen

    @classmethod
    def for_driver(cls, d: Driver) -> KVMirror:
        cfg = d.case.config
        return cls(cfg.block_size, cfg.num_gpu_blocks, cfg.enable_prefix_caching)  # type: ignore[arg-type]

    def held(self) -> Counter[int]:
        return Counter(b for t in self.tables.values() for b in t)

    def _write(self, table: list[int], pos: int, token: int, gen: int | None = None) -> None:
        block = table[pos // self.bs]
        if gen is None or self.gen[block] == gen:
            self.content[block][pos % self.bs] = token

    def on_schedule(self, d: Driver, out: SchedulerOutput, in_flight: bool) -> None:
        bs = self.bs
        self.before = {rid: list(t) for rid, t in self.tables.items()}
        for rid in out.preempted_req_ids | out.finished_req_ids:
            self.tables.pop(rid, None)
        held = self.held()
        self.admissions = []
        for sr in out.scheduled:
            rid, toks = sr.req_id, d.tokens(sr.req_id)
            start, ndraft = sr.num_computed_tokens, len(sr.draft_token_ids)
            if sr.block_table is not None:  # (re)admitted: held nothing until now
                assert rid not in self.tables, f"{rid} resumed while holding {self.tables[rid]}"
                assert sr.new_block_ids == sr.block_table, f"{rid}: new blocks != its table"
                table = list(sr.block_table)
                predicted = self.prefix.lookup(rid, toks)
                imports = d.imports_kv(rid)
                hits = len(predicted) if imports else start // bs
                if imports and table[:hits] != predicted:
                    self.hit_mismatches.append(f"{rid}: table {table[:hits]} != dict {predicted}")
                self.admissions.append(
                    Admission(rid, len(held), hits, predicted, table, len(toks), start)
                )
                for i, b in enumerate(table[:hits]):
                    want = dict(enumerate(toks[i * bs : (i + 1) * bs]))
                    if self.content[b] != want:
                        self.hit_mismatches.append(
                            f"{rid}: hit block {b} at index {i} holds {self.content[b]}, "
                            f"its tokens are {want}"
                        )
                fresh, self.prefix.reg_upto[rid] = table[hits:], hits
            else:
                assert rid in self.tables, f"{rid} scheduled without a table and no block_table"
                fresh = list(sr.new_block_ids)
                table = self.tables[rid] + fresh
            for b in fresh:
                assert held[b] == 0, (
                    f"step {out.step_id}: block {b} handed to {rid} while "
                    f"held by {[r for r, t in self.tables.items() if b in t]}"
                )
                self.gen[b] += 1
                self.content[b] = {}
                self.prefix.evict(b)
            held.update(fresh if sr.block_table is None else table)
            self.tables[rid] = table
            hi = start + sr.num_tokens - ndraft
            first = hits * bs if (sr.block_table is not None and d.imports_kv(rid)) else start
            for pos in range(first, hi):  # a DECODE admission's prompt KV arrives with it
                if pos < len(toks):
                    self._write(table, pos, toks[pos])
                else:  # an async placeholder: its token is known after the step in flight
                    self.pending.append((rid, pos, table[pos // bs], self.gen[table[pos // bs]]))
            self.comp[rid] = start + sr.num_tokens  # drafts included until verified
            self.sched_info[(out.step_id, rid)] = (table, hi, start)
            bound = hits * bs + 1 if (sr.block_table is not None and d.imports_kv(rid)) else hi
            self.prefix.register(rid, table, toks, min(bound, len(toks)) // bs)
        self._check_tables(d, "after schedule")

    def on_process(self, d: Driver, out: SchedulerOutput, res: ModelRunnerOutput) -> None:
        for sr in out.scheduled:
            tokens = res.sampled_token_ids.get(sr.req_id)
            info = self.sched_info.pop((out.step_id, sr.req_id), None)
            if not sr.will_sample or not tokens or sr.req_id not in self.tables or info is None:
                continue  # ended or preempted while in flight: nothing more from this step
            table, hi, _ = info
            accepted = len(tokens) - 1
            rejected = len(sr.draft_token_ids) - accepted
            self.comp[sr.req_id] -= rejected
            toks = d.tokens(sr.req_id)
            for pos in range(hi, min(hi + accepted, len(toks))):  # accepted drafts are real KV
                self._write(table, pos, toks[pos], self.gen[table[pos // self.bs]])
            if rejected:
                self._shift_later_steps(d, sr.req_id, out.step_id, rejected)
        still = []
        for rid, pos, block, gen in self.pending:
            toks = d.tokens(rid)
            if pos < len(toks):
                if self.gen[block] == gen:
                    self.content[block][pos % self.bs] = toks[pos]
            elif rid in self.tables:
                still.append((rid, pos, block, gen))
        self.pending = still
        live = d.sched.requests
        for sr in out.scheduled:
            rid = sr.req_id
            if (
                sr.will_sample
                and rid in live
                and rid in self.tables
                and rid in d.live_before_process
            ):
                toks = d.tokens(rid)
                # Up to the newest token: its KV is written by the next step, which under
                # async scheduling is in flight and may still fail.
                written = min(self.comp[rid], len(toks) - 1)
                self.prefix.register(rid, self.tables[rid], toks, written // self.bs)
        kv = d.sched.kv
        for rid in list(self.tables):
            if not kv.holds_blocks(rid):
                assert d.reqs[rid].is_finished, f"{rid} lost its blocks but is {d.reqs[rid]}"
                del self.tables[rid]
                continue
            core = kv.block_ids(rid)  # rejected draft slots are trimmed off the tail
            assert self.tables[rid][: len(core)] == core, (
                f"{rid}: core table {core} is not a prefix of {self.tables[rid]}"
            )
            self.tables[rid] = core
        self._check_tables(d, "after process")

    def _shift_later_steps(self, d: Driver, rid: str, step: int, rejected: int) -> None:
        """A step of `rid` scheduled before `step`'s verdict runs `rejected` positions
        earlier than its output says: move its recorded writes there."""
        for key, (table, hi, start) in list(self.sched_info.items()):
            if key[1] != rid or key[0] <= step:
                continue
            self.sched_info[key] = (table, hi - rejected, start - rejected)
            self.pending = [
                p for p in self.pending if not (p[0] == rid and hi - rejected <= p[1] < hi)
            ]
            toks = d.tokens(rid)
            for pos in range(start - rejected, min(start, hi - rejected)):
                block = table[pos // self.bs]
                if pos < len(toks):
                    self._write(table, pos, toks[pos], self.gen[block])
                else:
                    self.pending.append((rid, pos, block, self.gen[block]))

    def on_abort(self, d: Driver, req_id: str) -> None:
        self.tables.pop(req_id, None)
        self._check_tables(d, f"after aborting {req_id}")

    def _check_tables(self, d: Driver, when: str) -> None:
        core = {rid: d.sched.kv.block_ids(rid) for rid in d.sched.kv.req_blocks}
        assert core == self.tables, f"{when}: core tables {core} != from outputs {self.tables}"

    def shared_content_errors(self, d: Driver) -> list[str]:
        """Blocks in two or more tables whose recorded tokens disagree with a holder's."""
        where: dict[int, list[tuple[str, int]]] = {}
        for rid, table in self.tables.items():
            for i, b in enumerate(table):
                where.setdefault(b, []).append((rid, i))
        errors = []
        for b, holders in where.items():
            if len(holders) < 2:
                continue
            for rid, i in holders:
                toks = d.tokens(rid)
                for slot, tok in self.content[b].items():
                    pos = i * self.bs + slot
                    if pos < len(toks) and toks[pos] != tok:
                        errors.append(
                            f"block {b} shared by {holders}: slot {slot} holds {tok}, "
                            f"{rid} has {toks[pos]} at position {pos}"
                        )
        return errors
