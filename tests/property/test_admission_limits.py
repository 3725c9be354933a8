"""Admission against every limit the engine is given, and what it says about them.

The rest of the suite builds engines over the simulator, which states no vocabulary
and no model length. A real engine gets both: the model's maximum length
(`EngineCore(model_max_len=...)`) and the executor's vocabulary (`executor.vocab_size`).
Here they are drawn too, and the engine must:

- take the user's max_model_len, else the model's, capped by what one request can hold
  (the cache; without chunked prefill, also the step budget), and log one warning per
  cap that overrides a limit somebody set: the model's, by the step budget; the user's,
  by the cache (or budget). Each warning starts with the setting's name and gives the
  sizes involved;
- reject exactly the requests that can never be served, with a reason that gives the
  figures of the limit they break (the prompt's length and what it needs against the
  cache, max_model_len or the step budget; the first token outside the vocabulary and
  the vocabulary's bounds), or says the prompt is empty;
- refuse a request id that is already live, naming it, and count nothing for it.
"""

from __future__ import annotations

import logging
import re

from hypothesis import example, given
from hypothesis import strategies as st

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.kv_cache.manager import cdiv
from deepinfer.request import FinishReason, RequestStatus
from sim.sim_executor import SimExecutor
from tests.property.oracle import make_request
from tests.property.strategies import EngineCase, ReqSpec, Workload, cases_and_workloads, scaled

_INT = re.compile(r"-?\d+")


def _ints(text: str) -> list[int]:
    return [int(x) for x in _INT.findall(text)]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())  # a malformed message raises here


def _limit(case: EngineCase, model_max: int | None) -> tuple[int, list[list[int]]]:
    """The effective max_model_len, and the figures of each warning expected."""
    cfg = case.config
    budget = cfg.max_num_batched_tokens
    capacity = case.capacity if cfg.enable_chunked_prefill else min(case.capacity, budget)
    wanted = cfg.max_model_len or model_max
    if wanted is None:
        return capacity, []
    nb = case.capacity // cfg.block_size
    warnings = []
    chunked = cfg.enable_chunked_prefill
    if cfg.max_model_len is None and not chunked and budget < min(wanted, case.capacity):
        warnings.append([budget, wanted])  # the model's limit, capped by the budget
    if cfg.max_model_len is not None and wanted > capacity:  # the user's, by the cache
        warnings.append([wanted, nb, cfg.block_size, capacity])
    return min(wanted, capacity), warnings


def _expected_figures(
    case: EngineCase, spec: ReqSpec, limit: int, vocab: int | None
) -> list[int] | None:
    """The figures the rejection reason of `spec` gives, in order; None if admitted;
    [] for an empty prompt (no figure: the reason says it is empty)."""
    cfg, n = case.config, len(spec.prompt)
    bs = cfg.block_size
    if n == 0:
        return []
    if n + 1 > case.capacity:
        return [n, cdiv(n + 1, bs), bs, case.capacity // bs, case.capacity]
    if n + 1 > limit:
        return [n, limit]
    if vocab is not None:
        bad = next((t for t in spec.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            return [bad, 0, vocab]
    if not cfg.enable_chunked_prefill and n > cfg.max_num_batched_tokens:
        return [n, cfg.max_num_batched_tokens]
    return None


@st.composite
def _limits(draw: st.DrawFn) -> tuple[EngineCase, Workload, int | None, int | None]:
    """A case and workload, a model maximum length and a vocabulary size drawn around
    the workload's prompts and the cache, and some prompts made empty."""
    case, workload = draw(cases_and_workloads(max_capacity=256, aborts=False))
    cap = case.capacity
    model_max = draw(st.none() | st.integers(1, cap + 8))
    tokens = sorted({t for s in workload for t in s.prompt})
    vocab = draw(st.none() | st.sampled_from([t + d for t in tokens for d in (0, 1)]))
    empty = draw(st.sets(st.sampled_from([s.req_id for s in workload])))
    specs = tuple(
        ReqSpec(s.req_id, s.arrival_step, (), s.max_tokens) if s.req_id in empty else s
        for s in workload
    )
    return case, specs, model_max, vocab


def _case(chunked: bool, max_model_len: int | None = None) -> EngineCase:
    """16 blocks of 4 tokens, a step budget of 16."""
    cfg = EngineConfig(
        block_size=4,
        num_gpu_blocks=16,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
    )
    return EngineCase(cfg, 0.7)


# Explicit cases for mutmut's few-example profile: each cap and its warning, the edges
# of the budget cap, and one request breaking each limit.
_EACH_LIMIT = (
    ReqSpec("a", 0, (1, 2, 3, 4, 5), 2),
    ReqSpec("long", 0, tuple(range(1, 21)), 2),
    ReqSpec("empty", 0, (), 2),
    ReqSpec("vocab", 0, (1, 50, 51), 2),
    ReqSpec("zero", 0, (0, 1, 2), 2),  # token id 0 is in every vocabulary
    ReqSpec("huge", 0, tuple(1 + i % 49 for i in range(70)), 2),
)


@scaled(1.0)
@given(_limits())
@example((_case(chunked=False), _EACH_LIMIT, 40, 50))  # the model's limit, budget-capped
@example((_case(chunked=False), _EACH_LIMIT, 16, 50))  # the model's limit is the budget
@example((_case(chunked=True, max_model_len=100), _EACH_LIMIT, None, None))
def test_the_models_length_and_the_executors_vocabulary_limit_admission_with_reasons_giving_the_figures(
    drawn: tuple[EngineCase, Workload, int | None, int | None],
) -> None:
    """The engine's max_model_len is the user's, else the model's, capped by one
    request's room (cache, and the step budget without chunked prefill), with one
    warning per cap of a limit somebody set, starting with 'max_model_len' and giving
    the sizes (budget and model limit; or setting, cache blocks, block size and cap).
    Each request is admitted iff it fits every limit, the vocabulary's included; a
    rejected one ends rejected with a reason that gives the broken limit's figures in
    order, or says the prompt is empty. A live request id cannot be submitted twice.

    Caught: `EngineCore.__init____mutmut_9` / `_11` (the model's length, the
    executor's vocabulary not passed on), `rejection_reason__mutmut_29` (a token equal
    to the vocabulary size admitted), `_27` / `_28` (token id 0 refused), `_15` (the blocks needed miscounted),
    `_effective_max_model_len__mutmut_33` (a warning when the setting equals the cap),
    `_22` (the model's cap warned of when the user set the limit), `_23` .. `_28`
    (malformed warnings), `Scheduler.add_request__mutmut_2` (the duplicate unnamed)."""
    case, workload, model_max, vocab = drawn
    executor = SimExecutor(case.config, case.config.num_gpu_blocks)
    if vocab is not None:
        executor.vocab_size = vocab
    log = logging.getLogger("deepinfer.scheduler")
    handler = _Warnings()
    log.addHandler(handler)
    try:
        engine = EngineCore(case.config, executor, model_max_len=model_max)
    finally:
        log.removeHandler(handler)
    limit, warnings = _limit(case, model_max)
    assert engine.max_model_len == limit, f"max_model_len {engine.max_model_len}, not {limit}"
    assert len(handler.messages) == len(warnings), f"warned {handler.messages}, not {warnings}"
    for msg, figures in zip(handler.messages, warnings, strict=True):
        assert msg.startswith("max_model_len") and _ints(msg) == figures, (
            f"warning {msg!r} does not give {figures}"
        )
    sched = engine.scheduler
    for spec in workload:
        req = make_request(spec)
        reason = engine.add_request(req)
        want = _expected_figures(case, spec, limit, vocab)
        if want is None:
            assert reason is None, f"{spec} fits every limit, yet rejected: {reason}"
            submitted = sched.num_submitted
            try:
                engine.add_request(make_request(spec))
            except ValueError as e:
                assert repr(spec.req_id) in str(e), f"duplicate {spec.req_id}: {e}"
            else:
                raise AssertionError(f"{spec.req_id} submitted twice while live")
            assert sched.num_submitted == submitted, "a refused duplicate was counted"
            continue
        assert reason is not None, f"{spec} breaks a limit ({want}), yet admitted"
        assert req.status is RequestStatus.REJECTED and req.finish_reason is FinishReason.REJECTED
        assert req.reject_reason == reason and spec.req_id not in sched.requests
        if want:
            assert _ints(reason) == want, f"{spec}: reason {reason!r} does not give {want}"
        else:
            assert "empty" in reason, f"{spec}: an empty prompt, yet {reason!r}"
    assert sched.num_rejected == len(workload) - len(sched.requests)
