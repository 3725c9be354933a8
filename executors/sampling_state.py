"""One request's sampling state, kept by the model runner: its parameters, its token
history (the penalties' input and the seeded draw's index) and its seeded generator.
Every seeded draw is a pure function of (seed, output index, stream), so a seeded
request's tokens depend neither on the batch nor on preemption (executors/sampler.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingState:
    """What the sampler needs to know about one request, kept by the model runner.

    The runner appends every sampled token to `output_token_ids` before the next
    call: its length is both the penalty history and the seeded draw index.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None  # suppressed while len(outputs) < min_tokens
    # Created lazily on the logits' device when params.seq_seed is set.
    generator: torch.Generator | None = None

    def seeded_generator(
        self, device: torch.device, index: int | None = None, stream: int = 0
    ) -> torch.Generator | None:
        """The row's generator, re-seeded for one draw; None when unseeded.

        The draw is named by (output index, stream): `index` defaults to the number of
        outputs so far (the token being sampled); speculative decoding draws its drafts
        and acceptance tests from other streams at the index of the token concerned, so
        every draw is a pure function of the seed and never depends on the batch.
        """
        if self.params.seq_seed is None:
            return None
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device)
        step = len(self.output_token_ids) if index is None else index
        seed = self.params.seq_seed if stream == 0 else _mix_seed(self.params.seq_seed, -stream)
        self.generator.manual_seed(_mix_seed(seed, step))
        return self.generator


def _mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): nearby seeds and steps give unrelated streams."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits: accepted by every generator's manual_seed
