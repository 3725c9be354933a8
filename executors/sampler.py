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

Steps 2-5 short of the draw are `process_logits`, which speculative decoding
(executors/spec_decode.py, executors/mtp_drafter.py) shares so that drafts are
sampled from, and verified against, exactly the distributions sampled here.

Determinism: a row whose params carry `seq_seed` draws its noise alone from its
own generator, re-seeded from (seq_seed, number of outputs so far) on every
call, so its tokens depend neither on the other rows nor on its position in
the batch (nor on preemption: recomputing yields the same draws). Every
filtering step is row-wise and is an exact identity for a row that disables it,
so the other rows' settings cannot perturb a seeded row either. Unseeded rows
share one draw from the batch generator passed in (or torch's default one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.outputs import TokenLogprob
from deepinfer.sampling_params import SamplingParams
from executors.host_copy import to_device, to_device_async
from kernels import ops as kernel_ops

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


def rows_of(rows: list[int], n: int, device: torch.device) -> slice | torch.Tensor:
    """An index of `rows` among n: a slice when they are all of them, in order."""
    if rows == list(range(n)):
        return slice(None)
    return to_device(rows, torch.int64, device)


def _mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): nearby seeds and steps give unrelated streams."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits: accepted by every generator's manual_seed


def _counts(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Occurrences of each token per row. -> [num_reqs, vocab] float32."""
    width = max((len(r) for r in ids), default=0)
    padded = torch.full((len(ids), width + 1), vocab, dtype=torch.long)  # vocab: padding bin
    for i, row in enumerate(ids):
        padded[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    padded = padded.clamp_(0, vocab).to(device)
    counts = torch.zeros(len(ids), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalise tokens already seen, as HF and vLLM do.

    Repetition (tokens in prompt or output): positive logits are divided by the
    penalty, negative ones multiplied. Frequency subtracts penalty * count and
    presence subtracts penalty once, over output tokens only. Defaults (1, 0, 0)
    leave a row bit-for-bit unchanged.
    logits: [num_reqs, vocab]; presence, frequency, repetition: [num_reqs].
    """
    vocab = logits.shape[-1]
    out_counts = _counts(output_ids, vocab, logits.device)  # [num_reqs, vocab]
    seen = (_counts(prompt_ids, vocab, logits.device) > 0) | (out_counts > 0)
    rep = torch.where(seen, repetition[:, None].to(logits), torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency[:, None].to(logits) * out_counts
    return logits - presence[:, None].to(logits) * (out_counts > 0).to(logits)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits: [num_reqs, vocab] / temperature: [num_reqs] (> 0; use 1 for greedy rows)."""
    return logits / temperature[:, None].to(logits)


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value are kept). k <= 0: off.
    logits: [num_reqs, vocab]; k: [num_reqs] int, best on the host (its max sizes the
    top-k: read from the device, it would wait for the step)."""
    k_max = min(int(k.max()), logits.shape[-1]) if k.numel() else 0
    if k_max <= 0:
        return logits
    k = to_device_async(k, logits.device).to(torch.long).clamp(max=logits.shape[-1])
    top = logits.topk(k_max, dim=-1).values  # [num_reqs, k_max], descending
    kth = top.gather(1, (k.clamp(min=1) - 1)[:, None])  # [num_reqs, 1]
    kth = kth.masked_fill((k <= 0)[:, None], float("-inf"))  # disabled rows keep all
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of top tokens whose probability reaches p (>= 1: off).
    logits: [num_reqs, vocab]; p: [num_reqs]."""
    p = p.to(logits)
    sorted_asc, order = logits.sort(dim=-1, descending=False)  # [num_reqs, vocab]
    cum = sorted_asc.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= (1 - p)[:, None]
    drop_sorted[:, -1] = False  # the most likely token always survives
    drop_sorted &= (p < 1)[:, None]
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top one's (0: off).
    logits: [num_reqs, vocab]; min_p: [num_reqs]."""
    probs = logits.softmax(dim=-1)  # [num_reqs, vocab]
    threshold = min_p[:, None].to(logits) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


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


def suppress_stop_tokens(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """min_tokens: EOS (unless ignore_eos) and stop_token_ids get -inf while a row
    has fewer than min_tokens outputs. logits: [num_reqs, vocab]."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        if len(s.output_token_ids) >= s.params.min_tokens:
            continue
        stops = list(s.params.stop_token_ids)
        if s.eos_token_id is not None and not s.params.ignore_eos:
            stops.append(s.eos_token_id)
        for t in stops:
            if 0 <= t < vocab:
                rows.append(i)
                cols.append(t)
    if not rows:
        return logits
    logits = logits.clone()
    logits[rows, cols] = float("-inf")
    return logits


@dataclass
class Processed:
    """Logits after the history-dependent steps, and what random rows sample from."""

    logits: torch.Tensor  # [num_reqs, vocab] after min_tokens and penalties: greedy takes argmax
    random_rows: list[int]  # rows whose params sample (temperature > 0)
    probs: torch.Tensor | None  # [len(random_rows), vocab]: their processed distribution


def process_logits(logits: torch.Tensor, states: list[SamplingState]) -> Processed:
    """Steps 2-5 of the module docstring short of the draw: min_tokens, penalties, then
    for random rows temperature, min-p, top-k, top-p and softmax. Speculative decoding
    samples drafts from, and verifies them against, exactly these distributions.
    logits: [num_reqs, vocab] float32."""
    device = logits.device
    params = [s.params for s in states]
    logits = suppress_stop_tokens(logits, states)
    if any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in params):
        logits = apply_penalties(
            logits,
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            _row_tensor([p.presence_penalty for p in params], device),
            _row_tensor([p.frequency_penalty for p in params], device),
            _row_tensor([p.repetition_penalty for p in params], device),
        )
    rnd = [i for i, p in enumerate(params) if not p.greedy]
    if not rnd:
        return Processed(logits, rnd, None)
    sub = [params[i] for i in rnd]
    x = logits[rows_of(rnd, len(params), device)]
    x = apply_temperature(x, _row_tensor([p.temperature for p in sub], device))
    if any(p.min_p > 0 for p in sub):
        x = apply_min_p(x, _row_tensor([p.min_p for p in sub], device))
    if any(p.top_k > 0 for p in sub):
        x = apply_top_k(x, torch.tensor([p.top_k for p in sub]))
    if any(p.top_p < 1 for p in sub):
        x = apply_top_p(x, _row_tensor([p.top_p for p in sub], device))
    return Processed(logits, rnd, x.softmax(dim=-1))


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


def _row_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device)


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
