"""SimExecutor: the Executor contract with no model behind it.

Each step it returns one placeholder token per request that samples (the
scheduler finishes a request after its trace `output_len`, via max_tokens),
and when speculating it accepts draft j with the acceptance model's probability
for position j given the earlier drafts passed (sim/acceptance.py: measured on a
real model, or one fixed rate), drawn from a seeded generator so runs repeat exactly.
"""

from __future__ import annotations

import random
import zlib

from deepinfer.config import EngineConfig
from deepinfer.executor import Done
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from sim.acceptance import AcceptanceModel

# Placeholder tokens stay clear of id 0 so a user's EOS id is never produced.
_VOCAB = 1 << 20


class SimExecutor:
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
        self._rng = random.Random(config.seed)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # crc32 of each request id, computed once: it salts every token of the request.
        self._salts: dict[str, int] = {}
        # When speculating, req_id -> tokens in its (modelled) KV cache: under async
        # scheduling a step's num_computed_tokens assumes the drafts in flight were all
        # accepted.
        self._computed: dict[str, int] = {}
        # Varlen: each draft gets a confidence ~ Beta with mean the position's acceptance,
        # and is accepted with that probability (a calibrated drafter).
        self.varlen = config.enable_mtp_varlen
        self._confidences: dict[str, list[float]] = {}  # req_id -> its latest proposal's

    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        res = ModelRunnerOutput()
        rng = self._rng
        sampled = res.sampled_token_ids
        salts = self._salts
        if self.k:
            for rid in out.finished_req_ids | out.preempted_req_ids:
                self._computed.pop(rid, None)
                self._confidences.pop(rid, None)
        for sr in out.scheduled:
            if not self.k and not sr.draft_token_ids:
                if not sr.samples:
                    continue
                salt = salts.get(sr.req_id)
                if salt is None:
                    salt = salts[sr.req_id] = zlib.crc32(sr.req_id.encode())
                # The same token as below with accepted = 0: one per step, no rng draw.
                pos = sr.num_computed_tokens + sr.num_tokens
                sampled[sr.req_id] = [1 + ((salt + pos * 2654435761) % (_VOCAB - 1))]
                continue
            start = sr.num_computed_tokens
            if sr.block_table is None and sr.req_id in self._computed:
                start = self._computed[sr.req_id]
            self._computed[sr.req_id] = start + sr.num_tokens
            if not sr.samples:
                continue
            salt = salts.get(sr.req_id)
            if salt is None:
                salt = salts[sr.req_id] = zlib.crc32(sr.req_id.encode())
            accepted = 0
            conf = self._confidences.get(sr.req_id, [])
            for j in range(1, len(sr.draft_token_ids) + 1):  # stops at the first rejection
                p = (
                    conf[j - 1]
                    if self.varlen and j <= len(conf)
                    else self.acceptance.probability(j)
                )
                if rng.random() >= p:
                    break
                accepted += 1
            self.num_draft_tokens += len(sr.draft_token_ids)
            self.num_accepted_tokens += accepted
            self._computed[sr.req_id] -= len(sr.draft_token_ids) - accepted
            # A deterministic function of (request, position): repeatable across runs.
            # Position of the first sampled token: right after the last known token
            # (the draft slots being verified come after it).
            pos = start + sr.num_tokens - len(sr.draft_token_ids)
            res.sampled_token_ids[sr.req_id] = [
                1 + ((salt + (pos + j) * 2654435761) % (_VOCAB - 1)) for j in range(accepted + 1)
            ]
            if self.k:
                k = self.k if out.num_proposals is None else min(out.num_proposals, self.k)
                res.draft_token_ids[sr.req_id] = [1 + rng.randrange(_VOCAB - 1) for _ in range(k)]
                if self.varlen:
                    conf = [self._confidence(j) for j in range(1, k + 1)]
                    self._confidences[sr.req_id] = conf
                    res.draft_confidences[sr.req_id] = conf
        return res

    def _confidence(self, position: int, concentration: float = 4.0) -> float:
        """A draft's confidence: Beta-distributed around the position's acceptance."""
        p = min(max(self.acceptance.probability(position), 1e-3), 1 - 1e-3)
        return self._rng.betavariate(p * concentration, (1 - p) * concentration)

    def execute_async(self, out: SchedulerOutput) -> Done:
        return Done(self.execute(out))

    def can_overlap(self, out: SchedulerOutput) -> bool:
        """As the torch executor: a step with structured requests (their grammar accepts
        the tokens on the host) is launched once the step in flight is applied; a
        speculating step overlaps like any other (its drafts verified on the device)."""
        return not any(sr.structured for sr in out.scheduled)

    def shutdown(self) -> None:
        pass
