"""A real run writes its step log (`LLM(..., step_log=PATH)`, `deepinfer generate
--step-log`): every applied step, its shape, its host and device seconds, under a header
naming what it calibrates; `deepinfer profile --from-log` fits from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.cli import main
from deepinfer.model_config import load_model_config
from deepinfer.step_log_file import read_step_log
from sim.profiled_cost_model import PROFILES_DIR, load_profile


def test_an_llm_writes_each_step_it_applies(tmp_path: Path, tiny_models) -> None:
    tiny = tiny_models["v3_plain"]
    path = tmp_path / "steps.jsonl"
    llm = LLM(str(tiny.path), device="cpu", dtype="float32", block_size=4, step_log=path)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=6, ignore_eos=True),
        use_tqdm=False,
    )
    steps = list(llm.engine.steps)
    llm.shutdown()
    log = read_step_log(path)
    assert log.header["executor"] == "torch" and log.header["hardware"] == "cpu"
    assert load_model_config(log.header["model"]).name == load_model_config(tiny.path).name
    assert log.header["meta"]["dtype"] == "float32" and log.engine["block_size"] == 4
    assert [s.record for s in log.steps] == steps  # (the engine's own records, each)
    first = log.steps[0]
    assert sorted(g[1] for g in first.groups) == [3, 5, 7] and all(g[3] for g in first.groups)
    for step in log.steps:
        assert sum(g[0] * g[1] for g in step.groups) == step.record.num_batched_tokens
        assert step.record.duration > 0 and step.schedule_s > 0 and step.process_s > 0
        # On the CPU the launch runs its step: none overlaps, async scheduling or not;
        # its duration is its own time, and no device span is logged beside it.
        assert not step.overlapped
        assert step.device_s is None and step.seconds == step.record.duration


@pytest.mark.gpu
def test_on_cuda_each_step_logs_its_device_span_within_its_duration(
    tmp_path: Path, tiny_models
) -> None:
    """On CUDA every step's line holds its device span (CUDA events around its launch's
    work, read without a synchronisation) and its launch's host seconds, and without
    async scheduling both lie inside the step's duration (launch to results read on the
    host)."""
    tiny = tiny_models["v3_plain"]
    path = tmp_path / "steps.jsonl"
    llm = LLM(
        str(tiny.path), device="cuda", dtype="bfloat16", block_size=16, step_log=path,
        async_scheduling=False,
    )  # fmt: skip
    llm.generate(
        [{"prompt_token_ids": [1 + i % 200 for i in range(n)]} for n in (5, 40, 300)],
        SamplingParams(max_tokens=24, ignore_eos=True),
        use_tqdm=False,
    )
    llm.shutdown()
    steps = read_step_log(path).steps
    assert len(steps) >= 24
    for step in steps:
        assert step.device_s is not None and step.device_s > 0
        assert step.device_s <= step.record.duration + 1e-5, step
        # (the launch returns before its results are read: inside the duration too)
        assert step.launch_s is not None and 0 < step.launch_s <= step.record.duration + 1e-5


def test_a_step_log_of_several_engines_is_refused(tmp_path: Path, tiny_models) -> None:
    model = str(tiny_models["v3_plain"].path)
    with pytest.raises(ValueError, match="step_log: a step log holds one engine's steps"):
        LLM(model, device="cpu", disaggregate="1P1D", step_log=tmp_path / "x.jsonl")


def test_generate_writes_a_log_that_refines_the_shipped_profile(tmp_path: Path) -> None:
    path, out = tmp_path / "demo.jsonl", tmp_path / "refined.json"
    assert main([
        "generate", "def fibonacci(n):", "import os", "--model", "deepinfer-demo",
        "--device", "cpu", "--max-tokens", "12", "--ignore-eos", "true", "--step-log", str(path),
        "--block-size", "16", "--num-gpu-blocks", "256",
    ]) == 0  # fmt: skip
    base = PROFILES_DIR / "deepinfer-demo__cpu.json"
    assert main(["profile", "--from-log", str(path), "--base", str(base), "--out", str(out)]) == 0
    refined = load_profile(out)
    assert refined["meta"]["from_log"]["logs"] == [str(path)]
    assert any("logged_steps" in p for p in refined["points"])


def test_a_server_writes_its_steps_though_it_keeps_none(tmp_path: Path) -> None:
    """A server runs for days: its engine keeps no step records, and its step log gets
    every served step as it is applied."""
    from deepinfer.config import EngineConfig
    from deepinfer.entrypoints.openai.served_model import real_model
    from deepinfer.request import Request

    path = tmp_path / "served.jsonl"
    engine = EngineConfig(block_size=16, num_gpu_blocks=256)
    served = real_model("deepinfer-demo", engine, device="cpu", step_log=str(path))
    core = served.engine
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    core.add_request(Request("a", [5, 6, 7, 8, 9], params))
    while core.has_unfinished():
        served.step()
    served.shutdown()
    assert len(core.steps) == 0
    log = read_step_log(path)
    assert len(log.steps) >= 4 and log.steps[0].groups == [[1, 5, 0, True]]


def test_the_simulated_twin_has_no_step_log_option(tmp_path: Path, capsys) -> None:
    """Its steps are the cost model's: `deepinfer simulate --step-log` writes those."""
    code = main(["serve", "--executor", "sim", "--step-log", str(tmp_path / "x.jsonl")])
    assert code == 2
    assert "--step-log: not an option of --executor sim" in capsys.readouterr().err
