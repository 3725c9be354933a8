"""The simulator's acceptance model: per-position probabilities, measured on a model."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.model_config import load_model_config, write_config_with_mtp_layer
from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from sim import simulate
from sim.acceptance import AcceptanceModel
from sim.sim_executor import SimExecutor
from sim.traces import TraceRequest
from tests.factories import StepClock, make_config, make_request, run_to_completion


def test_conditional_probabilities_come_from_the_counts() -> None:
    m = AcceptanceModel.from_counts([100, 80, 40], [80, 40, 30])
    assert m.per_position == (0.8, 0.5, 0.75)
    assert m.probability(1) == 0.8 and m.probability(9) == 0.75  # past the end: the last
    assert m.expected_tokens(2) == pytest.approx(1 + 0.8 + 0.4)
    assert AcceptanceModel.from_counts([10, 0, 0], [0, 0, 0]).per_position == (0.0,)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        AcceptanceModel((1.5,))


def test_the_sim_executor_accepts_each_position_with_its_probability() -> None:
    """Scheduler.draft_position_stats (what measure-acceptance records) give back the
    model the SimExecutor was given."""
    model = AcceptanceModel((0.9, 0.5, 0.2))
    cfg = make_config(num_speculative_tokens=3, num_gpu_blocks=400, max_num_seqs=16)
    engine = EngineCore(cfg, SimExecutor(cfg, acceptance_rate=model), clock=StepClock())
    for i in range(16):
        engine.add_request(make_request(f"r{i}", 4, max_tokens=300))
    run_to_completion(engine)
    stats = engine.scheduler.draft_position_stats
    got = AcceptanceModel.from_counts([n for n, _ in stats], [a for _, a in stats])
    assert got.per_position == pytest.approx(model.per_position, abs=0.04)


def _accepted(seed: int, starts: Iterable[int], k: int, rate: float = 0.7) -> dict[int, int]:
    """Drafts one SimExecutor accepts of request "r", start -> accepted, stepping through
    `starts` in order, each step verifying k drafts after `start` computed tokens (its
    first draft guesses the token at start + 1)."""
    cfg = make_config(num_speculative_tokens=3, num_gpu_blocks=64, seed=seed)
    ex = SimExecutor(cfg, acceptance_rate=rate)
    accepted = {}
    for step_id, start in enumerate(starts, 1):
        sr = ScheduledRequest(
            "r", 1 + k, start, False, True, [], block_table=[0], draft_token_ids=[7] * k
        )
        res = ex.execute(SchedulerOutput(step_id, [sr], set(), set()))
        accepted[start] = len(res.sampled_token_ids["r"]) - 1
    return accepted


def test_a_drafted_token_meets_the_same_luck_in_every_chain_that_drafts_it() -> None:
    """Common random numbers: whether the draft of a token is accepted is drawn from the
    seed, the request and the token's position, not from a generator shared in step
    order, so runs of one trace under two policies differ by their policies. One
    executor verifies chains of 3 drafts, position after position; another verifies
    single drafts, in the opposite order: at one acceptance rate a token's draft passes
    alone exactly when it passes in the chain (its first draft, and its second when the
    first passed). Over many tokens the rate is the model's, and another seed draws
    other tokens."""
    chains = _accepted(0, range(600), 3)
    alone = _accepted(0, reversed(range(601)), 1)
    for start, chain in chains.items():
        assert alone[start] == min(chain, 1), start
        if chain:  # its second draft guesses the token the next start's first draft does
            assert alone[start + 1] == min(chain - 1, 1), start
    assert sum(alone.values()) / len(alone) == pytest.approx(0.7, abs=0.05)
    assert alone != _accepted(1, reversed(range(601)), 1)


def test_simulate_reads_a_shipped_acceptance_file() -> None:
    """By name under sim/data/acceptance/ (measured on the demo model): more tokens per
    step than a fixed low rate gives."""
    shipped = AcceptanceModel.load("deepinfer-demo")
    assert len(shipped.per_position) == 3 and shipped.expected_tokens(3) > 2
    reqs = [TraceRequest(f"r{i}", 0.0, 100, 64) for i in range(4)]
    cfg = make_config(
        num_speculative_tokens=3, num_gpu_blocks=200, block_size=16,
        max_num_batched_tokens=1024,
    )  # fmt: skip
    model = "executors/demo/deepinfer-demo/config.json"
    runs = {
        a: simulate(reqs, model, engine=cfg, cost_model="unit", acceptance_rate=a)
        for a in ("deepinfer-demo", 0.2)
    }
    assert runs["deepinfer-demo"].meta["acceptance_per_position"] == list(shipped.per_position)
    assert runs["deepinfer-demo"].meta["num_steps"] < runs[0.2].meta["num_steps"]
    with pytest.raises(ValueError, match="not a readable acceptance file"):
        AcceptanceModel.load("no-such-model")


def test_varlen_drafts_follow_confidence_and_fade_under_load(tmp_path: Path) -> None:
    """With DEEPINFER_ENABLE_MTP_VARLEN the SimExecutor reports confidences and the
    scheduler's policy sets each request's draft length from them and from the step
    times it measures, here the H200 profile's prices (Moonlight with an MTP layer): a
    lone request drafts long when drafts are likely, and only its confident drafts when
    they are not (at batch 1 a speculating step costs about 1.9x a decode step: the
    drafter's passes, and a verify forward whose tokens read more of the 64 experts'
    weights); a crowd
    of 512 with unlikely drafts (0.3) hardly drafts, since there a verify step plus the
    drafter's passes cost more than the 0.3 tokens a draft is expected to add."""
    model = load_model_config(write_config_with_mtp_layer("moonlight-16b-a3b", tmp_path))

    def mean_drafts(batch: int, acceptance: tuple[float, ...]) -> float:
        cfg = EngineConfig(
            num_speculative_tokens=3, enable_mtp_varlen=True, max_num_seqs=batch,
            max_num_batched_tokens=8192, block_size=64, async_scheduling=batch > 1,
        )  # fmt: skip
        reqs = [TraceRequest(f"r{i}", 0.0, 64, 80) for i in range(batch)]
        res = simulate(reqs, model, "h200", cfg, acceptance_rate=AcceptanceModel(acceptance))
        full = [s for s in res.steps if s.num_prompt_tokens == 0 and s.num_scheduled_reqs == batch]
        assert len(full) > 10
        return sum(s.num_batched_tokens / batch - 1 for s in full) / len(full)

    assert mean_drafts(1, (0.9, 0.85, 0.8)) > 2.5
    alone, crowd = mean_drafts(1, (0.3,)), mean_drafts(512, (0.3,))
    assert alone > 0.2 and crowd < 0.2 * alone, (alone, crowd)


def test_speculation_sizes_the_cache_with_the_mtp_layer() -> None:
    """As the torch executor: the MTP layer's weights and its KV (one more layer per
    block) leave fewer blocks."""
    from deepinfer.model_config import load_model_config
    from sim.hardware import get_hardware
    from sim.kv_capacity import kv_capacity_blocks

    model = load_model_config("executors/demo/deepinfer-demo/config.json")
    h200 = get_hardware("h200")
    plain = kv_capacity_blocks(model, h200, 64, 0.9)
    spec = kv_capacity_blocks(model, h200, 64, 0.9, speculative=True)
    layers = model.num_hidden_layers
    assert spec < plain and spec == pytest.approx(plain * layers / (layers + 1), rel=0.01)
