"""SimExecutor: the Executor contract with no model behind it.

Each step it returns one placeholder token per request that samples (the
scheduler finishes a request after its trace `output_len`, via max_tokens),
and when speculating it accepts draft j with the acceptance model's probability
for position j given the earlier drafts passed (sim/acceptance.py: measured on a
real model, or one fixed rate).

Every draw is a function of the seed, the request and the token position a draft
guesses (`_unit`: sim/keyed_draws.py; the draft's place j in the drafter's chain enters
only through the acceptance model's p(j)): runs repeat exactly, and two runs of the same trace under
different policies (draft lengths, batch sizes, async or not) meet the same luck
wherever they draft the same token, so a difference between them is the policy's, not
the dice's (common random numbers).
One generator drawn in step order would not do: a policy that verified one draft less
in one step would shift every later draw, and comparisons of policies would measure the
seed.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from deepinfer.config import EngineConfig
from deepinfer.executor import Executor
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from sim.acceptance import AcceptanceModel
from sim.keyed_draws import unit_draw as _unit

# Placeholder tokens stay clear of id 0 so a user's EOS id is never produced.
_VOCAB = 1 << 20
# A placeholder token is 1 + (salt + position * _STRIDE) mod (_VOCAB - 1).
_STRIDE = 2654435761
# A decode run's tokens from this many on are made as one array (numpy's fixed cost
# per call is that of about as many tokens made one by one).
_ARRAY_TOKENS = 128
# What a draw decides: a draft's acceptance, its token, its confidence; the last key of
# (seed, salt, position, kind) for the first and last, and before j for the token, so no
# key begins with another's.
_ACCEPT, _TOKEN, _CONFIDENCE = 1, 2, 3


class SimExecutor(Executor):
    needs_token_ids = False

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int | None = None,
        *,
        acceptance_rate: float | AcceptanceModel = 0.7,
    ) -> None:
        blocks = num_blocks if num_blocks is not None else config.num_gpu_blocks
        if blocks is None:
            raise ValueError("SimExecutor needs num_blocks (or EngineConfig.num_gpu_blocks)")
        if isinstance(acceptance_rate, AcceptanceModel):
            self.acceptance = acceptance_rate
        elif not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate={acceptance_rate}: must be in [0, 1]")
        else:
            self.acceptance = AcceptanceModel.fixed(acceptance_rate)
        self._num_blocks = blocks
        self.k = config.num_speculative_tokens
        self._seed = config.seed
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # crc32 of each live request's id, computed once: it salts every token of the
        # request; dropped when a step names the request finished (a server runs for days).
        self._salts: dict[str, int] = {}
        # When speculating, req_id -> tokens in its (modelled) KV cache: under async
        # scheduling a step's num_computed_tokens assumes the drafts in flight were all
        # accepted.
        self._computed: dict[str, int] = {}
        # Each draft has a confidence ~ Beta with mean its chain position's acceptance,
        # and is accepted with that probability (a calibrated drafter); varlen reads the
        # confidences.
        self.varlen = config.enable_mtp_varlen

    def num_kv_blocks(self) -> int:
        return self._num_blocks

    @property
    def can_fast_forward(self) -> bool:  # type: ignore[override]
        """A decode step's token is a function of (request, position) unless drafts are
        verified (their acceptance is drawn per step)."""
        return not self.k

    def execute_decode_run(
        self,
        req_ids: Sequence[str],
        contexts: Sequence[int],
        num_steps: Sequence[int],
        dropped_req_ids: frozenset[str],
    ) -> list[list[int]]:
        """The tokens `execute` samples for these steps: step s of request i computes
        position contexts[i] + s and samples the token at the position after it (the
        formula of `execute`, one list a request). Without drafts a request's salt is
        all that is held of it: dropped_req_ids drop theirs (a preempted request's
        comes back the same, from its id), and so do requests that end within the run."""
        salts = self._salts
        for rid in dropped_req_ids:
            salts.pop(rid, None)
        longest = max(num_steps, default=0)
        modulus = _VOCAB - 1
        stride = _STRIDE % modulus
        # Request i's token of its step s is 1 + (first[i] + s * stride) mod modulus:
        # salt + pos * _STRIDE with both terms reduced first (the same residues).
        firsts = []
        for rid, ctx, steps in zip(req_ids, contexts, num_steps):
            salt = salts.get(rid)
            if salt is None:
                salt = salts[rid] = zlib.crc32(rid.encode())
            firsts.append(salt % modulus + (ctx + 1) * stride)
            if steps < longest:
                del salts[rid]
        total = sum(num_steps)
        # One array only when it is dense: a ragged run (one long request among many
        # that end early) would fill a grid mostly of tokens thrown away.
        if total < _ARRAY_TOKENS or 2 * total < len(firsts) * longest:
            return [
                [1 + x % modulus for x in range(first, first + steps * stride, stride)]
                for first, steps in zip(firsts, num_steps)
            ]
        # [i, s] (int64 holds first + s * stride while positions stay below 2**43)
        grid = (
            np.array(firsts, dtype=np.int64)[:, None] + np.arange(longest, dtype=np.int64) * stride
        )
        out: list[list[int]] = (grid % modulus + 1).tolist()
        for row, steps in zip(out, num_steps):
            del row[steps:]  # (a request that ends within the run)
        return out

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        res = ModelRunnerOutput()
        seed = self._seed
        sampled = res.sampled_token_ids
        salts = self._salts
        for rid in out.finished_req_ids:
            salts.pop(rid, None)
        if self.k:
            for rid in out.finished_req_ids | out.preempted_req_ids:
                self._computed.pop(rid, None)
        for sr in out.scheduled:
            if not self.k and not sr.draft_token_ids:
                if not sr.will_sample:
                    continue
                salt = salts.get(sr.req_id)
                if salt is None:
                    salt = salts[sr.req_id] = zlib.crc32(sr.req_id.encode())
                # The same token as below with accepted = 0: one per step, no rng draw.
                pos = sr.num_computed_tokens + sr.num_tokens
                sampled[sr.req_id] = [1 + ((salt + pos * _STRIDE) % (_VOCAB - 1))]
                continue
            start = sr.num_computed_tokens
            if sr.block_table is None and sr.req_id in self._computed:
                start = self._computed[sr.req_id]
            self._computed[sr.req_id] = start + sr.num_tokens
            if not sr.will_sample:
                continue
            salt = salts.get(sr.req_id)
            if salt is None:
                salt = salts[sr.req_id] = zlib.crc32(sr.req_id.encode())
            # Position of the first sampled token: right after the last known token
            # (the draft slots being verified come after it); draft j guesses the token
            # at pos + j - 1.
            pos = start + sr.num_tokens - len(sr.draft_token_ids)
            accepted = 0
            for j in range(1, len(sr.draft_token_ids) + 1):  # stops at the first rejection
                guessed = pos + j - 1
                if _unit((seed, salt, guessed, _ACCEPT)) >= self._confidence(
                    seed, salt, guessed, j
                ):
                    break
                accepted += 1
            self.num_draft_tokens += len(sr.draft_token_ids)
            self.num_accepted_tokens += accepted
            self._computed[sr.req_id] -= len(sr.draft_token_ids) - accepted
            # A deterministic function of (request, position): repeatable across runs.
            res.sampled_token_ids[sr.req_id] = [
                1 + ((salt + (pos + j) * _STRIDE) % (_VOCAB - 1)) for j in range(accepted + 1)
            ]
            if self.k:
                k = self.k if out.num_proposals is None else min(out.num_proposals, self.k)
                # The next step's draft j guesses the token at pos + accepted + j.
                base = pos + accepted
                res.draft_token_ids[sr.req_id] = [
                    1 + int(_unit((seed, salt, base + j, _TOKEN, j)) * (_VOCAB - 1))
                    for j in range(1, k + 1)
                ]
                if self.varlen:
                    res.draft_confidences[sr.req_id] = [
                        self._confidence(seed, salt, base + j, j) for j in range(1, k + 1)
                    ]
        return res

    def _confidence(
        self, seed: int, salt: int, position: int, j: int, concentration: float = 4.0
    ) -> float:
        """The confidence of a draft that guesses the token at `position` as draft j of its
        chain: Beta-distributed around draft j's acceptance, at a quantile fixed by the
        position (whatever j: the same token looks as easy to every chain that drafts
        it, and with one acceptance for every j its confidence is the same). An
        acceptance of 0 or 1 is certain."""
        from scipy.special import betaincinv

        p = self.acceptance.probability(j)
        if p <= 0.0 or p >= 1.0:
            return p
        quantile = _unit((seed, salt, position, _CONFIDENCE))
        return float(betaincinv(p * concentration, (1 - p) * concentration, quantile))

    def can_overlap(self, out: SchedulerOutput) -> bool:
        """As the torch executor: a step with structured requests (their grammar accepts
        the tokens on the host) is launched once the step in flight is applied; a
        speculating step overlaps like any other (its drafts verified on the device)."""
        return not any(sr.structured for sr in out.scheduled)
