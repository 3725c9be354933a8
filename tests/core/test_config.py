"""No inert knobs: every option either works or is refused with an error naming it."""

from __future__ import annotations

import json

import pytest

from deepinfer import EngineConfig


@pytest.mark.parametrize(
    "name",
    [
        "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE",
        "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS",
    ],
)
def test_a_variable_of_an_unimplemented_feature_is_refused_naming_it(monkeypatch, name) -> None:
    monkeypatch.setenv(name, "1")
    with pytest.raises(ValueError, match=name):
        EngineConfig()
    monkeypatch.setenv(name, "0")  # explicitly off is no request for the feature
    EngineConfig()


def test_variable_length_drafts_turn_speculation_on_up_to_the_nextn_length(monkeypatch) -> None:
    """DEEPINFER_ENABLE_MTP_VARLEN=1 speculates with up to DEEPINFER_USE_NEXTN_DECODE drafts
    (5 by default); an explicit num_speculative_tokens is the maximum instead."""
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    assert EngineConfig().num_speculative_tokens == 5
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    cfg = EngineConfig()
    assert cfg.enable_mtp_varlen and cfg.num_speculative_tokens == 3
    assert EngineConfig(num_speculative_tokens=2).num_speculative_tokens == 2
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    with pytest.raises(ValueError, match="DEEPINFER_USE_NEXTN_DECODE"):
        EngineConfig()
    monkeypatch.delenv("DEEPINFER_ENABLE_MTP_VARLEN")
    monkeypatch.delenv("DEEPINFER_USE_NEXTN_DECODE")
    assert EngineConfig().num_speculative_tokens == 0
    assert EngineConfig(enable_mtp_varlen=True).num_speculative_tokens == 5


def test_batch_invariant_comes_from_the_variable_and_an_argument_overrides_it(
    monkeypatch,
) -> None:
    """DEEPINFER_BATCH_INVARIANT=1 is EngineConfig.batch_invariant's default; LLM(...)
    kwargs and the CLI take the same name (EngineConfig.from_dict)."""
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    assert EngineConfig().batch_invariant is False
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert EngineConfig().batch_invariant is True
    assert EngineConfig(batch_invariant=False).batch_invariant is False
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "off")
    assert EngineConfig().batch_invariant is False
    assert EngineConfig.from_dict({"batch_invariant": True}).batch_invariant is True
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes")  # type: ignore[arg-type]


def test_unknown_engine_option_is_named() -> None:
    with pytest.raises(ValueError, match="max_num_seq"):
        EngineConfig.from_dict({"max_num_seq": 4})


def test_cpu_threads_default_to_one_and_are_overridable(monkeypatch) -> None:
    from deepinfer import envs

    monkeypatch.delenv("DEEPINFER_CPU_THREADS", raising=False)
    assert envs.cpu_threads() == 1
    monkeypatch.setenv("DEEPINFER_CPU_THREADS", "4")
    assert envs.cpu_threads() == 4
    monkeypatch.setenv("DEEPINFER_CPU_THREADS", "0")
    with pytest.raises(ValueError, match="DEEPINFER_CPU_THREADS"):
        envs.cpu_threads()


def test_async_scheduling_is_on_by_default_except_over_several_ranks() -> None:
    """The default launches step N+1 while step N runs; a data-parallel engine (lock-step
    rounds, and expert parallelism refuses it) steps synchronously. The default is decided
    again when a config is replaced, an explicit setting is kept."""

    auto = EngineConfig()
    assert auto.async_scheduling is True
    assert EngineConfig(data_parallel_size=2).async_scheduling is False
    assert auto.replace(data_parallel_size=2).async_scheduling is False
    assert auto.replace(data_parallel_size=2).replace(data_parallel_size=1).async_scheduling
    ep = auto.replace(data_parallel_size=2, enable_expert_parallel=True)
    assert ep.async_scheduling is False
    off = EngineConfig(async_scheduling=False)
    assert off.replace(max_num_seqs=4).async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(data_parallel_size=2, enable_expert_parallel=True, async_scheduling=True)
    with pytest.raises(ValueError, match="async_scheduling='yes'"):
        EngineConfig(async_scheduling="yes")  # type: ignore[arg-type]


def test_to_dict_round_trips_with_the_async_default_still_automatic() -> None:
    """from_dict(cfg.to_dict()) is cfg, and a copy of a default config decides async
    scheduling again for its own data_parallel_size (asdict's resolved True would be
    kept, and a data-parallel copy refused by the simulator); an explicit one stays."""
    auto = EngineConfig(role="prefill", max_num_seqs=8)
    copy = EngineConfig.from_dict(auto.to_dict())
    assert copy == auto and copy.to_dict() == auto.to_dict()
    assert auto.to_dict()["async_scheduling"] is None and auto.to_dict()["role"] == "prefill"
    assert copy.replace(data_parallel_size=2).async_scheduling is False
    on = EngineConfig(async_scheduling=True)
    assert EngineConfig.from_dict(on.to_dict()).replace(max_num_seqs=4).async_scheduling is True
    json.dumps(auto.to_dict())  # JSON-ready


def test_fp8_with_expert_parallelism_is_refused_for_both_executors() -> None:
    with pytest.raises(ValueError, match="quantization='fp8' with enable_expert_parallel"):
        EngineConfig(data_parallel_size=2, enable_expert_parallel=True, quantization="fp8")
