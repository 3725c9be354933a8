"""What the rules predict from an engine case and a workload alone: the effective
max_model_len, which requests are admissible, how each ends, and the argued bounds
on steps, preemptions and progress that the driver and the checkers enforce.
"""

from __future__ import annotations

from deepinfer.kv_cache.manager import cdiv
from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from tests.property.sim_text import sim_text
from tests.property.strategies import EngineCase, ReqSpec, Workload, sim_token


def make_request(spec: ReqSpec) -> Request:
    """The engine request a spec describes (its lengths and stop conditions)."""
    params = SamplingParams(
        max_tokens=spec.max_tokens,
        min_tokens=spec.min_tokens,
        stop_token_ids=list(spec.stop_token_ids),
        ignore_eos=spec.ignore_eos,
        stop=list(spec.stop),
    )
    return Request(
        spec.req_id,
        list(spec.prompt),
        params,
        float(spec.arrival_step),
        priority=spec.priority,
        eos_token_id=spec.eos_token_id,
    )


def max_model_len(case: EngineCase) -> int:
    """The effective limit: the configured one capped by the cache and, without chunked
    prefill, by the step budget, so that a preempted request can be recomputed in one
    step (docs/design.md, "Rejection and max_model_len"; the rule that fixed bug B2)."""
    cfg = case.config
    limit = min(cfg.max_model_len or case.capacity, case.capacity)
    return limit if cfg.enable_chunked_prefill else min(limit, cfg.max_num_batched_tokens)


def admissible(case: EngineCase, spec: ReqSpec) -> bool:
    """Whether a request can ever be served, computed from the spec alone."""
    n, cfg = len(spec.prompt), case.config
    fits_step = cfg.enable_chunked_prefill or n <= cfg.max_num_batched_tokens
    return n >= 1 and n + 1 <= case.capacity and n + 1 <= max_model_len(case) and fits_step


def expected_end(case: EngineCase, spec: ReqSpec, text: bool = False) -> tuple[int, str]:
    """(output tokens, finish reason) an admitted request ends with when nobody aborts it
    (docs/design.md, "Stop conditions"): the first output token, counting from one, at
    a count >= min_tokens that is a stop token id or EOS (unless ignore_eos) stops it;
    else max_tokens, max_model_len, or in the PREFILL role its first token, is its length.
    The tokens are SimExecutor's (`sim_token`), a function of the position alone.

    With `text` (a loop that detokenizes, as `LLM` does: sim_text.TextStops), a token at
    a count >= min_tokens whose text completes one of its stop strings, searched from
    the longest stop string's length before the new text, ends it with reason stop,
    also when that token reached a length limit (as vLLM's output processor says)."""
    n, length = len(spec.prompt), max_model_len(case)
    stops = set(spec.stop_token_ids)
    if not spec.ignore_eos and spec.eos_token_id is not None:
        stops.add(spec.eos_token_id)
    decoded = ""
    count = 0
    while True:
        count += 1
        token = sim_token(spec.req_id, n + count - 1)
        if count >= spec.min_tokens and token in stops:
            return count, "stop"
        if text and spec.stop:
            before = len(decoded)
            decoded += sim_text(token)
            if count >= spec.min_tokens and any(
                decoded.find(s, max(0, before - len(s) + 1)) >= 0 for s in spec.stop
            ):
                return count, "stop"
        if count >= spec.max_tokens or n + count >= length or case.config.role.value == "prefill":
            return count, "length"


def expected_outputs(case: EngineCase, spec: ReqSpec) -> int:
    """Output tokens an admitted request ends with when nobody aborts it."""
    return expected_end(case, spec)[0]


def preemption_bound(case: EngineCase, workload: Workload) -> int:
    """An argued bound, checked on every run: between two steps that preempt some
    request gains an output token or ends (the oldest running request, or the
    prefill that a lone request gave way to, goes on), and a step preempts each
    running request at most once."""
    admitted = [s for s in workload if admissible(case, s)]
    progress = sum(expected_outputs(case, s) + 1 for s in admitted)
    return len(admitted) * progress


def step_bound(case: EngineCase, workload: Workload) -> int:
    """Engine steps within which every admissible request must have finished.

    Every step schedules at least one token (NoIdleStep); the tokens to compute
    are each prompt, each output with its drafts, and one whole recompute (plus
    one step of slack) per preemption.
    """
    k, length = case.config.num_speculative_tokens, max_model_len(case)
    work = sum(
        len(s.prompt) + expected_outputs(case, s) * (1 + k) for s in workload if admissible(case, s)
    )
    steps = max((s.arrival_step for s in workload), default=0) + 1
    steps += work + preemption_bound(case, workload) * (length + 1)
    return 2 * steps + 2 if case.config.async_scheduling else steps


def progress_window(case: EngineCase) -> int:
    """Steps within which the progress measure must rise (see test_no_livelock)."""
    cfg = case.config
    w = cdiv(max_model_len(case), cfg.max_num_batched_tokens) + 3
    return 2 * w + 2 if cfg.async_scheduling else w
