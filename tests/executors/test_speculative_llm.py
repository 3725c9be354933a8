"""Speculative decoding on the real executor (CPU): MTP drafts verified in one step leave
greedy output token-for-token unchanged, keep the sampling distribution, stay
deterministic when seeded, and never overrun max_tokens.

Acceptance needs a drafter that predicts the target: the trained demo model (its MTP
layer agrees with the target about 70% of the time) serves those tests; the tiny
random-weight V3 checks the MTP layer against transformers'."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from scipy.stats import chi2_contingency

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.engine import EngineCore
from deepinfer.executor import Executor
from deepinfer.model_config import ModelConfig
from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.request import Request
from executors.demo import DEMO_MODEL_DIR
from executors.kv_cache import PagedKVCache
from executors.loader import load_model, read_hf_config
from executors.model_runner import ModelRunner
from tests.executors.harness import load_runner
from tests.executors.test_llm import prompts
from tests.executors.test_torch_executor import _prompt_step
from tests.executors.tiny_models import TinyModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
CODE = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\nclass ",
    '    def __repr__(self):\n        return "<%s ',
    "for i in range(10):\n    ",
]
needs_demo = pytest.mark.skipif(
    not (DEMO_MODEL_DIR / "model.safetensors").is_file(), reason="demo checkpoint not built"
)


def _generate(
    model: str, batch: list[list[int]] | list[str], params: SamplingParams | list, **engine
) -> LLM:
    engine.setdefault("block_size", 4)
    llm = LLM(model, device="cpu", dtype="float32", **engine)
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in batch]
    llm.outs = llm.generate(inputs, params, use_tqdm=False)  # type: ignore[attr-defined]
    return llm


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(num_speculative_tokens=1),
        dict(num_speculative_tokens=3, max_num_batched_tokens=8),  # chunked prefill
        dict(num_speculative_tokens=2, num_gpu_blocks=20, max_num_batched_tokens=64),
        dict(num_speculative_tokens=3, async_scheduling=True, max_num_batched_tokens=8),
        dict(
            num_speculative_tokens=2,
            async_scheduling=True,
            num_gpu_blocks=20,
            max_num_batched_tokens=64,
        ),
        dict(enable_mtp_varlen=True, num_speculative_tokens=5),
        dict(enable_mtp_varlen=True, num_speculative_tokens=4, async_scheduling=True),
    ],
    ids=[
        "k1",
        "k3-chunked",
        "k2-preempting",
        "k3-async-chunked",
        "k2-async-preempting",
        "varlen5",
        "varlen4-async",
    ],
)
@needs_demo
def test_greedy_output_is_identical_with_speculation(engine_args: dict) -> None:
    """Token for token what the engine gives without speculation, and drafts were really
    verified (some accepted, some rejected)."""
    spec_free = {
        k: v
        for k, v in engine_args.items()
        if k not in ("num_speculative_tokens", "enable_mtp_varlen")
    }
    plain = _generate(str(DEMO_MODEL_DIR), CODE, GREEDY, **spec_free)
    spec = _generate(str(DEMO_MODEL_DIR), CODE, GREEDY, **engine_args)
    for a, b in zip(plain.outs, spec.outs):  # type: ignore[attr-defined]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) == GREEDY.max_tokens
    sched = spec.engine.scheduler
    assert 0 < sched.num_accepted_drafts < sched.num_draft_tokens
    if "num_gpu_blocks" in engine_args:
        assert sched.num_preemptions > 0


@needs_demo
def test_tokens_after_a_stop_string_are_dropped() -> None:
    """Accepted drafts past the token that completes a stop string are not output: ids,
    text and logprobs equal plain decoding's."""
    params = SamplingParams(temperature=0.0, max_tokens=60, stop=["\n\n", ":"], logprobs=1)
    plain = _generate(str(DEMO_MODEL_DIR), CODE, params, block_size=16)
    spec = _generate(str(DEMO_MODEL_DIR), CODE, params, block_size=16, num_speculative_tokens=3)
    for a, b in zip(plain.outs, spec.outs):  # type: ignore[attr-defined]
        x, y = a.outputs[0], b.outputs[0]
        assert (y.token_ids, y.text, y.finish_reason) == (x.token_ids, x.text, x.finish_reason)
        assert len(y.logprobs) == len(y.token_ids)


@needs_demo
def test_a_stop_string_before_max_tokens_in_one_step_ends_it_with_reason_stop() -> None:
    """A step whose accepted drafts complete a stop string and then reach max_tokens (or
    a stop token) ends the request on the stop string: reason stop, the tokens up to it,
    and its record says so (docs/design.md, "Stop conditions")."""
    stop = SamplingParams(temperature=0.0, max_tokens=60, stop=["\n\n", ":"])
    plain = _generate(str(DEMO_MODEL_DIR), CODE, stop, block_size=16)
    outs = [o.outputs[0] for o in plain.outs]  # type: ignore[attr-defined]
    codes = [p for p, o in zip(CODE, outs) if o.finish_reason == "stop"]
    firsts = [o for o in outs if o.finish_reason == "stop"]
    assert firsts, "no stop string in CODE's greedy text"
    for extra in (1, 2, 3):
        params = [dataclasses.replace(stop, max_tokens=len(o.token_ids) + extra) for o in firsts]
        spec = _generate(
            str(DEMO_MODEL_DIR), codes, params, block_size=16, num_speculative_tokens=3
        )
        for x, out in zip(firsts, spec.outs):  # type: ignore[attr-defined]
            y = out.outputs[0]
            assert (y.token_ids, y.finish_reason, y.stop_reason) == (
                x.token_ids,
                "stop",
                x.stop_reason,
            ), f"max_tokens {len(x.token_ids) + extra}"
        records = {r.req_id: r for r in spec.engine.records}
        for x, out in zip(firsts, spec.outs):  # type: ignore[attr-defined]
            rec = records[out.request_id]
            assert (rec.num_output_tokens, rec.finish_reason) == (len(x.token_ids), "stop")


@needs_demo
def test_no_request_exceeds_max_tokens() -> None:
    """Accepted drafts past max_tokens (or a stop token) are dropped."""
    for n in (1, 2, 3, 5, 7):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm = _generate(str(DEMO_MODEL_DIR), CODE[:3], params, num_speculative_tokens=3)
        assert [len(o.outputs[0].token_ids) for o in llm.outs] == [n] * 3  # type: ignore[attr-defined]


def test_mtp_draft_is_the_reference_mtp_argmax(tiny_models: dict[str, TinyModel]) -> None:
    """The first draft after a prompt is the argmax of transformers' MtpModel at the last
    prompt position, fed the token just sampled; its confidence is that probability."""
    tiny = tiny_models["v3_mtp"]
    prompt = prompts(7, [9])[0]
    runner = load_runner(tiny.path, num_blocks=16, num_speculative_tokens=2)
    out = runner.execute(SchedulerOutput(1, [_prompt_step("a", prompt, [0, 1, 2])]))
    first = out.sampled_token_ids["a"][0]
    with torch.no_grad():
        hidden = tiny.hf.model(torch.tensor([prompt])).last_hidden_state  # [1, n, hidden]
        tokens = torch.tensor([prompt[1:] + [first]])
        ref = tiny.mtp._project_to_logits(
            tiny.mtp.forward_layer(
                0, hidden, torch.arange(1, len(prompt) + 1)[None], None, input_ids=tokens
            )
        )[0, -1].softmax(-1)
    assert out.draft_token_ids["a"][0] == int(ref.argmax())
    assert out.draft_confidences["a"][0] == pytest.approx(float(ref.max()), rel=1e-4)
    assert len(out.draft_token_ids["a"]) == 2


def test_seeded_sampling_with_speculation_is_deterministic(
    tiny_models: dict[str, TinyModel],
) -> None:
    """A seeded request gives the same tokens alone and amid other requests."""
    tiny = tiny_models["v3_mtp"]
    prompt = prompts(8, [6])[0]
    seeded = SamplingParams(temperature=0.9, seed=123, max_tokens=12, ignore_eos=True)
    alone = _generate(str(tiny.path), [prompt], seeded, num_speculative_tokens=2)
    llm = LLM(str(tiny.path), device="cpu", dtype="float32", block_size=4, num_speculative_tokens=2)
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = prompts(9, [4, 7]) + [prompt]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in batch], [others, others, seeded], use_tqdm=False
    )
    assert outs[2].outputs[0].token_ids == alone.outs[0].outputs[0].token_ids  # type: ignore[attr-defined]


@needs_demo
def test_speculative_sampling_matches_plain_sampling() -> None:
    """At temperature 1 the second and third output tokens (accepted drafts or tokens
    sampled after a rejection, the third often in a verify step chained on the one in
    flight under async scheduling) have the distributions they have without
    speculation (chi-square, two samples)."""
    from tests.executors.test_spec_chain import count_chained

    n = 800
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    counts: dict[int, list[torch.Tensor]] = {1: [], 2: []}
    for k in (0, 2):
        llm = LLM(
            str(DEMO_MODEL_DIR), device="cpu", dtype="float32", num_speculative_tokens=k,
            max_num_seqs=n, max_num_batched_tokens=16 * n, block_size=16, seed=k,
            async_scheduling=True,
        )  # fmt: skip
        chained = count_chained(llm.executor.runner)  # type: ignore[attr-defined]
        outs = llm.generate([CODE[3]] * n, params, use_tqdm=False)
        for i in counts:
            tokens = torch.tensor([o.outputs[0].token_ids[i] for o in outs])
            counts[i].append(torch.bincount(tokens, minlength=8192))
        if k:
            assert llm.engine.scheduler.num_accepted_drafts > 0
            assert any(chained), chained
    for i, pair in counts.items():
        table = torch.stack(pair)  # [2, vocab]
        common = table.sum(0) >= 20
        merged = torch.cat([table[:, common], table[:, ~common].sum(1, keepdim=True)], dim=1)
        assert merged.shape[1] > 5, i
        assert chi2_contingency(merged.numpy()).pvalue > 1e-3, i


@needs_demo
def test_measure_acceptance_writes_the_file_the_simulator_reads(tmp_path: Path) -> None:
    from deepinfer.entrypoints.cli import main
    from sim.acceptance import AcceptanceModel

    out = tmp_path / "acc.json"
    argv = [
        "measure-acceptance", "--device", "cpu", "--dtype", "float32", "--num-prompts", "2",
        "--max-tokens", "12", "--prompt-chars", "120", "--num-speculative-tokens", "2",
        "--block-size", "16", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["num_speculative_tokens"] == 2 and data["reached"][0] > 0
    model = AcceptanceModel.load(out)
    assert 0 < model.per_position[0] <= 1 and list(model.per_position) == data["per_position"]


@pytest.mark.gpu
@needs_demo
@pytest.mark.parametrize(
    "dtype,async_scheduling",
    [("float32", True), ("bfloat16", False), ("bfloat16", True)],
)
def test_greedy_output_is_identical_with_speculation_on_cuda(
    dtype: str, async_scheduling: bool
) -> None:
    """On the device (Triton kernels, CUDA graphs for decode and verify steps), token for
    token, and most drafts accepted. In float32 every sequence. bf16 rounds a 1 + k-token
    verify query differently from a one-token decode, and in a MoE a near-tie in the
    router can then pick another expert, which can move the next token by any margin: when
    decode attention's pieces went from 128 keys to 64 (2026-12-05), one of the four
    sequences parted at token 62 where plain decoding's top two logprobs were 0.63 apart
    (and agreed again with 128). So in bf16 most sequences, not all."""
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    outs = {}
    for k in (0, 3):
        llm = LLM(
            str(DEMO_MODEL_DIR), device="cuda", dtype=dtype, block_size=16,
            num_speculative_tokens=k, async_scheduling=async_scheduling,
        )  # fmt: skip
        outs[k] = [o.outputs[0].token_ids for o in llm.generate(CODE, params, use_tqdm=False)]
        if k:
            sched = llm.engine.scheduler
            assert sched.num_accepted_drafts > 0.4 * sched.num_draft_tokens
            assert llm.executor.runner.verify_graphs is not None
        llm.executor.shutdown()  # the next engine takes 0.9 of the device too
    identical = sum(spec == plain for plain, spec in zip(outs[0], outs[3]))
    assert identical == len(CODE) if dtype == "float32" else identical >= len(CODE) // 2


class _RunnerExecutor(Executor):
    """The Executor contract over a bare ModelRunner (to switch its graphs on, on the CPU)."""

    needs_token_ids = True

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks()

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(out)


def _greedy_through_runner(
    model: torch.nn.Module, prompts_: list[list[int]], graphs: bool
) -> tuple[list[list[int]], list[int], list[int], int]:
    """Greedy outputs from an engine over a bare runner; the batch sizes the verify
    graphs served; the row counts the drafter's graphs served; drafts accepted."""
    cfg = model.config
    engine_cfg = EngineConfig(block_size=16, num_gpu_blocks=64, num_speculative_tokens=3)
    cache = PagedKVCache(
        cfg.num_hidden_layers, 64, 16, cfg.kv_entry_dim, torch.float32, torch.device("cpu"),
        scratch_block=True, num_mtp_layers=1,
    )  # fmt: skip
    runner = ModelRunner(model, cache, engine_cfg, eos_token_id=1, max_model_len=512)
    calls: list[int] = []
    rows: list[int] = []
    if graphs:
        runner.enable_cuda_graphs([1, 2, 4], capture=False)
        verify = runner.verify_graphs
        assert verify is not None and verify.query_len == 4
        run = verify.run
        verify.run = lambda i, p, t, *f: calls.append(len(t)) or run(i, p, t, *f)  # type: ignore[method-assign]
        speculator = runner.speculator
        assert speculator is not None and speculator.drafter.graphs is not None
        draft_graphs = speculator.drafter.graphs
        run_rows = draft_graphs.run_rows
        draft_graphs.run_rows = lambda h, i, p, *t: rows.append(len(p)) or run_rows(h, i, p, *t)  # type: ignore[method-assign]
    outputs, accepted = _greedy(runner, engine_cfg, prompts_)
    return outputs, calls, rows, accepted


def _greedy(
    runner: ModelRunner, engine_cfg: EngineConfig, prompts_: list[list[int]]
) -> tuple[list[list[int]], int]:
    """24 greedy tokens of each prompt from an engine over `runner`; drafts accepted."""
    engine = EngineCore(engine_cfg, _RunnerExecutor(runner), model_max_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reqs = [Request(f"r{i}", p, params) for i, p in enumerate(prompts_)]
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs], engine.scheduler.num_accepted_drafts


@needs_demo
def test_verify_steps_run_through_graph_buffers_and_give_the_same_tokens() -> None:
    """With graphs on, steps where every request scores 1 + k tokens take the verify
    graphs (padded static buffers; run eagerly on the CPU) and the MTP drafter reads
    their hidden states; the drafter's passes take its own graphs (one-row queries)
    and propose what its eager varlen passes propose: greedy output and the drafts
    accepted equal the eager engine's."""
    from tokenizers import Tokenizer

    cfg = ModelConfig.from_dict(read_hf_config(DEMO_MODEL_DIR))
    model = load_model(DEMO_MODEL_DIR, cfg, dtype=torch.float32, device=torch.device("cpu"))
    tok = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    prompts_ = [tok.encode(p).ids for p in CODE[:3]]
    eager, _, _, eager_accepted = _greedy_through_runner(model, prompts_, graphs=False)
    graphed, calls, rows, accepted = _greedy_through_runner(model, prompts_, graphs=True)
    assert graphed == eager and len(calls) > 3
    assert accepted == eager_accepted > 0
    assert len(rows) > 10 and max(rows) > 3  # chained passes and multi-row first passes


def _varlen_demo_runner(model: torch.nn.Module) -> tuple[ModelRunner, EngineConfig]:
    """A CPU runner of the demo model (k = 3, varlen) over a cache with a scratch block."""
    cfg = model.config
    engine_cfg = EngineConfig(block_size=16, num_gpu_blocks=64, num_speculative_tokens=3,
                              enable_mtp_varlen=True)  # fmt: skip
    cache = PagedKVCache(
        cfg.num_hidden_layers, 64, 16, cfg.kv_entry_dim, torch.float32, torch.device("cpu"),
        scratch_block=True, num_mtp_layers=1,
    )  # fmt: skip
    runner = ModelRunner(model, cache, engine_cfg, eos_token_id=1, max_model_len=512)
    return runner, engine_cfg


@needs_demo
def test_shorter_uniform_verify_steps_take_their_own_graphs(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Varlen steps verify one length L for every request (spec_policy): with graphs on,
    a step of 1 + L tokens a request takes the graphs captured for that query length
    (here L = 1 and 2 of k = 3, forced in turn), with the eager engine's greedy output."""
    from tokenizers import Tokenizer

    import deepinfer.draft_plan as draft_plan_module

    cfg = ModelConfig.from_dict(read_hf_config(DEMO_MODEL_DIR))
    model = load_model(DEMO_MODEL_DIR, cfg, dtype=torch.float32, device=torch.device("cpu"))
    tok = Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    prompts_ = [tok.encode(p).ids for p in CODE[:3]]
    steps = iter(range(1 << 30))

    def alternating(conf, max_len, **_):  # type: ignore[no-untyped-def]
        length = 1 + next(steps) % 2
        return {rid: min(length, len(c)) for rid, c in conf.items()}

    monkeypatch.setattr(draft_plan_module, "draft_lengths", alternating)
    outputs, served = [], []
    for graphs in (False, True):
        runner, engine_cfg = _varlen_demo_runner(model)
        if graphs:
            runner.enable_cuda_graphs([1, 2, 4], capture=False)
            assert sorted(runner.verify_graphs_by_len) == [2, 3, 4]
            for q, g in runner.verify_graphs_by_len.items():
                run = g.run
                g.run = lambda i, p, t, *f, q=q, run=run: served.append(q) or run(i, p, t, *f)  # type: ignore[method-assign]
        outputs.append(_greedy(runner, engine_cfg, prompts_)[0])
    assert outputs[0] == outputs[1]
    assert {2, 3} <= set(served) and 4 not in served


@needs_demo
def test_every_verify_length_is_graphed_at_every_batch_size() -> None:
    """The graphs end at the final norm (the logits of the sampled rows are computed
    outside them), so no size keeps a [rows, vocab] output alive and every query length
    1..1 + k has a graph at every captured batch size."""
    cfg = ModelConfig.from_dict(read_hf_config(DEMO_MODEL_DIR))
    model = load_model(DEMO_MODEL_DIR, cfg, dtype=torch.float32, device=torch.device("cpu"))
    runner, _ = _varlen_demo_runner(model)
    runner.enable_cuda_graphs([1, 2, 4, 8], capture=False)
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8]
    assert sorted(runner.verify_graphs_by_len) == [2, 3, 4]
    for q, g in runner.verify_graphs_by_len.items():
        assert g.sizes == [1, 2, 4, 8]
        hidden = g.run([5] * 3 * q, list(range(q)) * 3, [[0], [1], [2]])
        assert hidden.shape == (4 * q, cfg.hidden_size)  # padded to 4 requests
