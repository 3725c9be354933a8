"""Token sampling: small pure torch functions plus one batched entry point.

`sample_tokens(logits, states)` runs, per row, in this order (vLLM v1's):

1. raw logprobs = log_softmax(logits), when any row asked for logprobs. Like
   vLLM's default `logprobs_mode="raw_logprobs"`, they describe the model's own
   distribution, before min_tokens, penalties, temperature and top-k/p/min-p.
2. min_tokens: EOS and stop_token_ids get -inf until min_tokens outputs exist.
3. repetition / frequency / presence penalties.
4. temperature == 0: argmax (greedy; no randomness consumed).
5. otherwise temperature, min-p, top-k, top-p, then an exponential race
   (argmax of probs / q with q ~ Exp(1), the Gumbel-max trick in prob space).

Steps 2-5 short of the draw are `process_logits` (executors/logits_processors.py),
which speculative decoding (executors/spec_decode.py) shares, so that drafts are
verified against exactly the distributions sampled here.

Determinism: a row whose params carry `seq_seed` draws its noise alone from its
own generator, re-seeded from (seq_seed, number of outputs so far) on every
call, so its tokens depend neither on the other rows nor on its position in
the batch (nor on preemption: recomputing yields the same draws). Every
filtering step is row-wise and is an exact identity for a row that disables it,
so the other rows' settings cannot perturb a seeded row either. Unseeded rows
share one draw from the batch generator passed in (or torch's default one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.outputs import TokenLogprob
from deepinfer.sampling_params import SamplingParams
from executors.logits_processors import process_logits, rows_of
from executors.sampling_state import SamplingState
from kernels import ops as kernel_ops


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Per row: [chosen token, then the top-`logprobs` tokens (ranks 1..n)]; an
    # empty list for a row that asked for none. None when no row asked.
    logprobs: list[list[TokenLogprob]] | None = None


@dataclass
class LogprobTensors:
    """The logprobs a step returns, still on the device (`to_lists` reads them back)."""

    chosen: torch.Tensor  # [num_reqs] float32: the sampled token's logprob
    ranks: torch.Tensor  # [num_reqs] int64
    top_vals: torch.Tensor  # [num_reqs, n_max]
    top_ids: torch.Tensor  # [num_reqs, n_max]

    def to_lists(
        self, token_ids: list[int], params: list[SamplingParams]
    ) -> list[list[TokenLogprob]]:
        """Per row: the chosen token, then the top-n tokens with ranks 1..n."""
        ranks, chosen = self.ranks.tolist(), self.chosen.tolist()
        top_vals, top_ids = self.top_vals.tolist(), self.top_ids.tolist()
        out: list[list[TokenLogprob]] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append([])
                continue
            row = [TokenLogprob(token_ids[i], chosen[i], ranks[i])]
            n = min(p.logprobs, len(top_ids[i]))
            row += [TokenLogprob(top_ids[i][j], top_vals[i][j], j + 1) for j in range(n)]
            out.append(row)
        return out


@dataclass
class DeviceSample:
    """`sample_on_device`'s result: nothing read back yet, so the host need not wait."""

    token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: LogprobTensors | None
    # The copy back (copy_to_host): host tensors and the event that marks it done.
    _host: tuple[torch.Tensor, LogprobTensors | None] | None = None
    _copied: torch.cuda.Event | None = None

    def copy_to_host(self) -> None:
        """Queue the copy of the results into pinned host memory now. Read later with
        `.tolist()`, a device tensor waits for everything queued on the stream by then,
        such as the next step, launched meanwhile (async scheduling)."""
        if self.token_ids.device.type != "cuda":
            return

        def back(t: torch.Tensor) -> torch.Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        lp = self.logprobs
        host_lp = None
        if lp is not None:
            host_lp = LogprobTensors(
                *(back(t) for t in (lp.chosen, lp.ranks, lp.top_vals, lp.top_ids))
            )
        self._host = (back(self.token_ids), host_lp)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def to_host(self, params: list[SamplingParams]) -> SamplerOutput:
        """Wait for the device (for the copy back, when queued) and read the tokens (and
        logprobs)."""
        token_ids, logprobs = self.token_ids, self.logprobs
        if self._host is not None:
            assert self._copied is not None
            self._copied.synchronize()
            token_ids, logprobs = self._host
        ids = token_ids.tolist()
        lists = None if logprobs is None else logprobs.to_lists(ids, params)
        return SamplerOutput(token_ids=ids, logprobs=lists)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits: [num_reqs, vocab] -> [num_reqs] long."""
    return logits.argmax(dim=-1)


def random_sample(
    probs: torch.Tensor,
    generators: list[torch.Generator | None],
    batch_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Exponential race: argmax(probs / q), q ~ Exp(1), equals sampling from probs.

    A row with its own generator draws its q alone from it (batch-invariant);
    the other rows share one draw from `batch_generator` (None: torch's default).
    probs: [num_reqs, vocab] -> [num_reqs] long.
    """
    q = torch.empty_like(probs)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        noise = torch.empty(len(shared), probs.shape[-1], dtype=probs.dtype, device=probs.device)
        q[rows_of(shared, len(generators), probs.device)] = noise.exponential_(
            generator=batch_generator
        )
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    q = q.clamp_(min=torch.finfo(q.dtype).tiny)  # Exp(1) may round to 0
    return (probs / q).argmax(dim=-1)


def raw_logprobs(
    logits: torch.Tensor, states: list[SamplingState], batch_invariant: bool = False
) -> torch.Tensor | None:
    """log_softmax of the model's logits when any row asked for logprobs, else None.
    batch_invariant: each row reduced alone in a fixed order (kernels.ops.log_softmax)."""
    if any(s.params.logprobs is not None for s in states):
        return kernel_ops.log_softmax(logits, batch_invariant)  # [num_reqs, vocab] float32
    return None


def sample_tokens(
    logits: torch.Tensor,
    states: list[SamplingState],
    generator: torch.Generator | None = None,
    batch_invariant: bool = False,
) -> SamplerOutput:
    """Pick one token per row. logits: [num_reqs, vocab] (cast to float32).

    `generator` serves the unseeded random rows (the runner seeds it from
    EngineConfig.seed); it must live on the logits' device. batch_invariant: the
    logprobs' log-softmax runs row by row (`raw_logprobs`); greedy and seeded rows are
    batch-invariant in either mode, unseeded random rows in neither (they share a draw).
    """
    params = [s.params for s in states]
    return sample_on_device(logits, states, generator, batch_invariant).to_host(params)


def sample_on_device(
    logits: torch.Tensor,
    states: list[SamplingState],
    generator: torch.Generator | None = None,
    batch_invariant: bool = False,
) -> DeviceSample:
    """`sample_tokens` short of reading the result back: every step is queued on the
    device and the host does not wait (unless a row's penalties or min_tokens need its
    history copied over, which only the host holds)."""
    assert logits.dim() == 2 and logits.shape[0] == len(states), (logits.shape, len(states))
    logits = logits.float()
    raw = raw_logprobs(logits, states, batch_invariant)
    proc = process_logits(logits, states)
    token_ids = greedy(proc.logits)  # [num_reqs]
    if proc.random_rows:
        assert proc.probs is not None
        gens = [states[i].seeded_generator(logits.device) for i in proc.random_rows]
        rows = rows_of(proc.random_rows, len(states), logits.device)
        token_ids[rows] = random_sample(proc.probs, gens, generator)
    params = [s.params for s in states]
    logprobs = logprob_tensors(raw, token_ids, params) if raw is not None else None
    return DeviceSample(token_ids, logprobs)


def logprob_tensors(
    logprobs: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
) -> LogprobTensors:
    """The chosen token's logprob and rank (how many tokens are at least as likely, 1: the
    most likely; vLLM's count) and the top-n, on the device.
    logprobs: [num_reqs, vocab]; token_ids: [num_reqs]."""
    n_max = min(max(p.logprobs or 0 for p in params), logprobs.shape[-1])
    chosen = logprobs.gather(1, token_ids[:, None])  # [num_reqs, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # [num_reqs]
    top_vals, top_ids = logprobs.topk(n_max, dim=-1)  # [num_reqs, n_max]
    return LogprobTensors(chosen[:, 0], ranks, top_vals, top_ids)


def gather_logprobs(
    logprobs: torch.Tensor | None, token_ids: torch.Tensor, params: list[SamplingParams]
) -> list[list[TokenLogprob]]:
    """Per row: the chosen token with its logprob and rank, then the top-n tokens with
    ranks 1..n (`logprob_tensors`, read back). logprobs: [num_reqs, vocab]."""
    assert logprobs is not None
    return logprob_tensors(logprobs, token_ids, params).to_lists(token_ids.tolist(), params)
