"""A hand-driven stand-in for the scheduler: builds SchedulerOutputs for a ModelRunner.

`Driver` hands out block ids, tracks each sequence's tokens and computed count,
and records the logits the runner sampled from, keyed by the position whose
next token they predict, so tests can compare them with transformers' logits
of one full forward over the final sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer.config import EngineConfig, EngineRole
from deepinfer.model_config import ModelConfig
from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from deepinfer.sampling_params import SamplingParams
from executors.kv_cache import PagedKVCache
from executors.loader import load_model, read_hf_config
from executors.model_runner import ModelRunner, StepResult

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def load_runner(
    path: Path,
    *,
    block_size: int = 4,
    num_blocks: int = 256,
    num_speculative_tokens: int = 0,
    role: EngineRole = EngineRole.NORMAL,
) -> ModelRunner:
    cfg = ModelConfig.from_dict(read_hf_config(path))
    model = load_model(path, cfg, dtype=torch.float32, device=torch.device("cpu"))
    cache = PagedKVCache(
        cfg.num_hidden_layers,
        num_blocks,
        block_size,
        cfg.kv_entry_dim,
        torch.float32,
        torch.device("cpu"),
        num_mtp_layers=min(1, cfg.num_nextn_predict_layers) if num_speculative_tokens else 0,
    )
    engine = EngineConfig(
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        num_speculative_tokens=num_speculative_tokens,
        role=role,
    )
    return ModelRunner(model, cache, engine, eos_token_id=cfg.eos_token_id)


@dataclass
class Seq:
    tokens: list[int]
    num_prompt: int
    num_computed: int = 0
    table: list[int] | None = None  # None: the runner holds no state (send the whole table)
    shared: list[int] = field(default_factory=list)  # blocks reused from another sequence
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> [vocab]


class Driver:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.bs = runner.block_size
        self.next_block = 0
        self.seqs: dict[str, Seq] = {}
        self.step_id = 0
        self.pending_preempted: set[str] = set()

    def add(
        self,
        req_id: str,
        prompt: list[int],
        share_blocks_of: str | None = None,
        num_shared_blocks: int = 0,
    ) -> Seq:
        seq = Seq(list(prompt), len(prompt))
        if share_blocks_of is not None:
            seq.shared = self.seqs[share_blocks_of].table[:num_shared_blocks]
            seq.num_computed = num_shared_blocks * self.bs  # a prefix-cache hit
        self.seqs[req_id] = seq
        return seq

    def preempt(self, req_id: str) -> None:
        seq = self.seqs[req_id]
        seq.table, seq.num_computed, seq.shared = None, 0, []
        self.pending_preempted.add(req_id)

    def step(
        self, work: dict[str, int], finished: set[str] | frozenset = frozenset()
    ) -> StepResult:
        """work: req_id -> tokens to compute (None-like 0 is not allowed)."""
        scheduled = [self._schedule(req_id, n) for req_id, n in work.items()]
        self.step_id += 1
        out = SchedulerOutput(self.step_id, scheduled, set(finished), self.pending_preempted)
        self.pending_preempted = set()
        res = self.runner.step(out)
        for sr in scheduled:
            seq = self.seqs[sr.req_id]
            seq.num_computed += sr.num_tokens
            if sr.req_id in res.output.sampled_token_ids:
                toks = res.output.sampled_token_ids[sr.req_id]
                assert len(toks) == 1
                seq.logits[seq.num_computed - 1] = res.logits[sr.req_id][-1]
                seq.tokens.extend(toks)
        return res

    def decode_all(self, steps: int) -> None:
        for _ in range(steps):
            self.step({rid: 1 for rid in self.seqs})

    def _schedule(self, req_id: str, n: int) -> ScheduledRequest:
        seq = self.seqs[req_id]
        first = seq.table is None
        table = list(seq.shared) if first else seq.table
        end = seq.num_computed + n
        assert end <= len(seq.tokens), (req_id, end, len(seq.tokens))
        need = -(-end // self.bs) - len(table)
        new = list(range(self.next_block, self.next_block + max(0, need)))
        self.next_block += len(new)
        seq.table = table + new
        return ScheduledRequest(
            req_id=req_id,
            num_tokens=n,
            num_computed_tokens=seq.num_computed,
            is_prompt=seq.num_computed < seq.num_prompt,
            will_sample=end == len(seq.tokens),
            new_block_ids=new,
            block_table=list(seq.table) if first else None,
            token_ids=seq.tokens[seq.num_computed : end],
            sampling_params=GREEDY if first else None,
            num_prompt_tokens=seq.num_prompt,
        )


@torch.no_grad()
def max_rel_error(driver: Driver, hf: torch.nn.Module) -> float:
    """max |ours - hf| / max |hf| over every recorded logits row of every sequence."""
    worst = 0.0
    for seq in driver.seqs.values():
        assert seq.logits, "no logits recorded"
        ref = hf(torch.tensor([seq.tokens])).logits[0]  # [len, vocab]
        for pos, row in seq.logits.items():
            row = row.float().cpu()
            err = (row - ref[pos]).abs().max() / ref[pos].abs().max()
            worst = max(worst, float(err))
    return worst
