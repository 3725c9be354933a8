"""Structured outputs on the torch executor: compiled grammars, matchers, token masks.

- `GrammarCompiler` (one per executor): xgrammar's view of the model's vocabulary, built
  once from the checkpoint's own tokenizer, and each `so_args` grammar compiled against
  it in a worker thread (xgrammar releases the GIL while it compiles), cached by
  `grammar_key` in an LRU of futures. The engine waits on the future, not the loop.
- `GrammarState` (one per structured request, held by the model runner): an xgrammar
  `GrammarMatcher` kept in step with the request's output tokens; draft tokens are
  checked against it and it is rolled back after.
- `TokenMasks` (one per runner): per step, one bitmask row per constrained sampling row
  filled on the CPU (while the device may still run the step's forward: nothing has
  synchronised yet), then disallowed logits set to -inf on the logits' device.

xgrammar is imported on first use, so a server without structured requests never pays
for it (it imports transformers).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepinfer.structured_outputs import GrammarKey, build_grammar, grammar_key
from deepinfer.tokenizer import load_tokenizer
from executors.grammar_vocab import tokenizer_info
from kernels import ops


class GrammarCompiler:
    """Compiles `so_args` grammars for one model's vocabulary, off the engine loop.

    vocab_size: the model's (its logits' width); ids the tokenizer lacks are never
    allowed. stop_ids: the model's end tokens, allowed once a grammar accepts.
    """

    def __init__(
        self,
        model_dir: Path,
        vocab_size: int,
        stop_ids: list[int],
        max_cached: int = 256,
        trust_remote_code: bool = False,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.trust_remote_code = trust_remote_code
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self.max_cached = max_cached
        self._cache: OrderedDict[GrammarKey, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()  # the runner and the engine both look grammars up
        self._pool: ThreadPoolExecutor | None = None
        self._backend: Future[Any] | None = None  # xgrammar's GrammarCompiler, built once

    def submit(self, so_args: dict[str, Any]) -> Future[Any]:
        """The compile of `so_args`'s grammar (a CompiledGrammar future), started if new.
        ValueError when this executor cannot compile grammars at all."""
        key = grammar_key(so_args)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            backend = self._start()
            grammar = build_grammar(so_args)  # parsed (and checked) at SamplingParams already
            assert self._pool is not None
            compiled = self._pool.submit(lambda: backend.result().compile_grammar(grammar))
            self._cache[key] = compiled
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)  # a live request recompiles it if it needs it
            return compiled

    def compiled(self, so_args: dict[str, Any]) -> Any:
        """The CompiledGrammar, waiting for its compile if it is still running."""
        return self.submit(so_args).result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _start(self) -> Future[Any]:
        """The first grammar loads xgrammar and the tokenizer here (so a missing one is a
        ValueError at add_request) and builds the vocabulary view in the worker."""
        if self._backend is not None:
            return self._backend
        try:
            import xgrammar as xgr
        except ImportError:
            raise ValueError(
                "SamplingParams.so_args: structured outputs need xgrammar "
                "(pip install 'deepinfer[torch]' or pip install xgrammar)"
            ) from None
        try:
            tokenizer = load_tokenizer(self.model_dir, self.trust_remote_code)
        except FileNotFoundError as e:
            raise ValueError(
                f"SamplingParams.so_args: structured outputs need the model's tokenizer: {e}"
            ) from None
        threads = max(1, min(8, os.cpu_count() or 1))

        def build() -> Any:
            stop = self.stop_ids or tokenizer.eos_token_ids  # the model's, else the tokenizer's
            info = tokenizer_info(tokenizer, self.vocab_size, stop)
            return xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-grammar")
        self._backend = self._pool.submit(build)
        return self._backend


class GrammarViolation(ValueError):
    """A sampled token the grammar does not allow (its mask was not applied)."""


class GrammarState:
    """A structured request's matcher, in step with its output tokens.

    `done`: the grammar has ended (a stop token was accepted, or it accepts the output and
    allows nothing but a stop token): the request is complete.
    """

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)  # unlimited rollback (xgrammar >= 0.2)
        self.stop_ids: list[int] = compiled.tokenizer_info.stop_token_ids
        self.vocab_size: int = compiled.tokenizer_info.vocab_size
        self.num_accepted = 0
        self.done = False
        self._next_mask: torch.Tensor | None = None  # [words] int32, filled when checking done

    def catch_up(self, outputs: list[int]) -> None:
        """Accept `outputs` beyond those already accepted (a resumed request replays its
        history; a matcher ahead of it rolls back). GrammarViolation if one is not allowed."""
        if self.num_accepted > len(outputs):
            self.rollback(self.num_accepted - len(outputs))
        self.accept(outputs[self.num_accepted :])

    def accept(self, tokens: list[int]) -> int:
        """Advance over sampled `tokens`; returns how many belong to the output: all of
        them, or those up to the one that ended the grammar (the rest were sampled past
        its end and are dropped). GrammarViolation if one is not allowed."""
        for n, t in enumerate(tokens):
            if self.done:
                return n
            if not self._advance(t):
                raise GrammarViolation(f"token {t} is not allowed by the so_args grammar")
        return len(tokens)

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)
            self.num_accepted -= n
            self.done, self._next_mask = False, None

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask[row] ([words] int32, bit i of word w: id 32 * w + i) = allowed ids."""
        if self._next_mask is not None:
            bitmask[row] = self._next_mask
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def mask_ready(self) -> bool:
        """The next mask is already known (filled while checking `done`): a copy."""
        return self._next_mask is not None

    def fill_with_drafts(self, bitmask: torch.Tensor, first: int, drafts: list[int]) -> list[int]:
        """Fill rows first .. first + len(drafts): row j masks the token after drafts[:j].
        Each draft is checked against the grammar as it goes; at the first it does not
        allow (or past the grammar's end) the rows stop, since the token sampled there
        cannot match that draft and verification ends. The matcher is rolled back to where
        it was. Returns the rows filled."""
        rows, advanced = [], 0
        for j in range(len(drafts) + 1):
            if self.done:
                break
            self.fill(bitmask, first + j)
            rows.append(first + j)
            if j == len(drafts) or not self._advance(drafts[j]):
                break
            advanced += 1
        self.rollback(advanced)
        return rows

    def _advance(self, token: int) -> bool:
        if not self.matcher.accept_token(token):
            return False
        self.num_accepted += 1
        self._next_mask = None
        self.done = self.matcher.is_terminated() or (
            self.matcher.is_completed() and self._only_stop_allowed()
        )
        return True

    def _only_stop_allowed(self) -> bool:
        mask = torch.empty((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(mask, 0)
        self._next_mask = mask[0]  # reused as the next step's mask
        words = mask[0].numpy().view(np.uint32).copy()
        for t in self.stop_ids:
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
        return not words.any()


class TokenMasks:
    """One step's token bitmask: filled on the CPU, applied to the logits on their device.

    The runner calls `apply` after launching the forward and before the sampler first
    synchronises, so on CUDA the fill overlaps the device's work. Rows without drafts are
    filled together by xgrammar's BatchGrammarMatcher (its own threads, GIL released);
    the host buffer is pinned on CUDA and reused (the sampler synchronises every step
    before the next fill, so a copy never reads a buffer being rewritten).
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.words = (vocab_size + 31) // 32
        self._host: torch.Tensor | None = None  # [rows, words] int32
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, made on first use

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, GrammarState, list[int]]]) -> None:
        """Mask `logits` ([N, vocab] float32, in place) at each (first row, state, drafts):
        rows of a grammar that has ended are left alone (their tokens are dropped)."""
        import xgrammar as xgr

        host = self._buffer(logits.shape[0])
        filled: list[int] = []
        matchers, indices = [], []
        for first, state, drafts in rows:
            if state.done:
                continue
            if drafts or state.mask_ready:
                filled += state.fill_with_drafts(host, first, drafts)
            else:
                matchers.append(state.matcher)
                indices.append(first)
        if matchers:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(matchers, host, indices)
            filled += indices
        if not filled:
            return
        if logits.device.type == "cpu":  # xgrammar's C++ kernel
            xgr.apply_token_bitmask_inplace(
                logits, host, vocab_size=self.vocab_size, indices=sorted(filled), backend="cpu"
            )
            return
        # One Triton kernel (kernels/token_mask.py, compiled at start-up by `warm_up`);
        # xgrammar's torch path runs six full-width passes and indexes rows with host
        # lists, each a blocking copy that waits for the forward.
        rows = torch.tensor(sorted(filled), dtype=torch.int64).pin_memory()
        ops.apply_token_bitmask(
            logits,
            host.to(logits.device, non_blocking=True),
            rows.to(logits.device, non_blocking=True),
            self.vocab_size,
        )

    def warm_up(self) -> None:
        """Compile the mask kernel for this vocabulary now, not in the first served step."""
        if self.device.type != "cuda":
            return
        logits = torch.zeros((1, self.vocab_size), dtype=torch.float32, device=self.device)
        mask = torch.full((1, self.words), -1, dtype=torch.int32, device=self.device)
        rows = torch.zeros(1, dtype=torch.int64, device=self.device)
        ops.apply_token_bitmask(logits, mask, rows, self.vocab_size)

    def _buffer(self, n: int) -> torch.Tensor:
        """The first n rows of the host buffer, all allowed (-1): it grows as needed."""
        if self._host is None or self._host.shape[0] < n:
            size = max(n, 2 * self._host.shape[0] if self._host is not None else 64)
            pin = self.device.type == "cuda"
            self._host = torch.empty((size, self.words), dtype=torch.int32, pin_memory=pin)
        host = self._host[:n]
        host.fill_(-1)
        return host
