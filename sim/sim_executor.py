"""SimExecutor: the Executor contract with no model behind it.

Each step it returns one placeholder token per request that samples (the
scheduler finishes a request after its trace `output_len`, via max_tokens),
and when speculating it accepts each draft token with a fixed probability,
drawn from a seeded generator so runs repeat exactly.
"""

from __future__ import annotations

import random
import zlib

from deepinfer.config import EngineConfig
from deepinfer.executor import Done
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput

# Placeholder tokens stay clear of id 0 so a user's EOS id is never produced.
_VOCAB = 1 << 20


class SimExecutor:
    needs_token_ids = False

    def __init__(
        self, config: EngineConfig, num_blocks: int | None = None, *, acceptance_rate: float = 0.7
    ) -> None:
        blocks = num_blocks if num_blocks is not None else config.num_gpu_blocks
        if blocks is None:
            raise ValueError("SimExecutor needs num_blocks (or EngineConfig.num_gpu_blocks)")
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate={acceptance_rate}: must be in [0, 1]")
        self._num_blocks = blocks
        self.k = config.num_speculative_tokens
        self.acceptance_rate = acceptance_rate
        self._rng = random.Random(config.seed)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # crc32 of each request id, computed once: it salts every token of the request.
        self._salts: dict[str, int] = {}

    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        res = ModelRunnerOutput()
        rng = self._rng
        sampled = res.sampled_token_ids
        salts = self._salts
        for sr in out.scheduled:
            if not sr.samples:
                continue
            salt = salts.get(sr.req_id)
            if salt is None:
                salt = salts[sr.req_id] = zlib.crc32(sr.req_id.encode())
            if not self.k and not sr.draft_token_ids:
                # The same token as below with accepted = 0: one per step, no rng draw.
                pos = sr.num_computed_tokens + sr.num_tokens
                sampled[sr.req_id] = [1 + ((salt + pos * 2654435761) % (_VOCAB - 1))]
                continue
            accepted = 0
            for _ in sr.draft_token_ids:  # verification stops at the first rejection
                if rng.random() >= self.acceptance_rate:
                    break
                accepted += 1
            self.num_draft_tokens += len(sr.draft_token_ids)
            self.num_accepted_tokens += accepted
            # A deterministic function of (request, position): repeatable across runs.
            # Position of the first sampled token: right after the last known token
            # (the draft slots being verified come after it).
            pos = sr.num_computed_tokens + sr.num_tokens - len(sr.draft_token_ids)
            res.sampled_token_ids[sr.req_id] = [
                1 + ((salt + (pos + j) * 2654435761) % (_VOCAB - 1)) for j in range(accepted + 1)
            ]
            if self.k:
                res.draft_token_ids[sr.req_id] = [
                    1 + rng.randrange(_VOCAB - 1) for _ in range(self.k)
                ]
        return res

    def execute_async(self, out: SchedulerOutput) -> Done:
        return Done(self.execute(out))

    def shutdown(self) -> None:
        pass
