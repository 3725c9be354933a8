"""The paged DeepSeek model reproduces transformers' logits (eager attention, float32, CPU).

Error metric: max |ours - reference| / max |reference| over the compared logits.
"""

from __future__ import annotations

import random

import torch

from executors.attention import build_attention_metadata
from executors.kv_cache import PagedKVCache
from tests.executors.harness import Driver, load_runner, max_rel_error
from tests.executors.tiny_models import TinyModel

TOL = 1e-4


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 256) for _ in range(n)] for n in lengths]


@torch.no_grad()
def test_prefill_logits_match_transformers_at_every_position(tiny: TinyModel) -> None:
    """One flattened batch of three prompts, prefill path and absorbed path alike."""
    runner = load_runner(tiny.path)
    model, bs = runner.model, runner.block_size
    lengths = [7, 13, 3]
    prompts = _prompts(lengths)
    tables, next_block = [], 0
    for n in lengths:
        tables.append(list(range(next_block, next_block + -(-n // bs))))
        next_block += len(tables[-1])
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lengths])
    ref = torch.cat([tiny.hf(torch.tensor([p])).logits[0] for p in prompts])
    for num_decode_reqs in (0, len(lengths)):  # all full MLA, then all absorbed
        cfg = model.config
        cache = PagedKVCache(
            cfg.num_hidden_layers, 32, bs, cfg.kv_entry_dim, torch.float32, torch.device("cpu")
        )
        md = build_attention_metadata(
            lengths, [0] * 3, tables, bs, num_decode_reqs, torch.device("cpu")
        )
        logits = model.compute_logits(model(ids, positions, md, cache.layers))
        err = float((logits - ref).abs().max() / ref.abs().max())
        assert err < TOL, (tiny.name, num_decode_reqs, err)


def test_incremental_decode_matches_transformers_every_step(tiny: TinyModel) -> None:
    """Prompts of different lengths spanning several 4-token blocks, decoded together."""
    d = Driver(load_runner(tiny.path, block_size=4))
    for i, prompt in enumerate(_prompts([5, 11, 17])):
        d.add(f"r{i}", prompt)
    d.step({rid: len(s.tokens) for rid, s in d.seqs.items()})
    d.decode_all(10)
    assert all(len(s.logits) == 11 for s in d.seqs.values())
    assert max_rel_error(d, tiny.hf) < TOL


def test_chunked_prefill_alongside_decodes_matches_transformers(tiny: TinyModel) -> None:
    d = Driver(load_runner(tiny.path, block_size=4))
    long, short = _prompts([23, 6], seed=1)
    d.add("long", long)
    d.add("short", short)
    d.step({"long": 7, "short": 6})  # first chunk; the short prompt completes
    d.step({"long": 5, "short": 1})  # second chunk next to a decode
    d.step({"long": 11, "short": 1})  # last chunk: samples
    d.decode_all(4)
    assert len(d.seqs["long"].logits) == 5
    assert max_rel_error(d, tiny.hf) < TOL


def test_prefix_cache_hit_reuses_written_blocks(tiny_models: dict[str, TinyModel]) -> None:
    """b's first 3 blocks are a's: b starts with num_computed_tokens = 12 and never
    writes them, so matching logits prove it reads a's cached latents."""
    tiny = tiny_models["v3_mtp"]
    d = Driver(load_runner(tiny.path, block_size=4))
    a, tail = _prompts([14, 5], seed=2)
    d.add("a", a)
    d.step({"a": 14})
    d.decode_all(2)
    d.add("b", a[:12] + tail, share_blocks_of="a", num_shared_blocks=3)
    d.step({"b": 5, "a": 1})
    d.decode_all(3)
    assert d.seqs["b"].table[:3] == d.seqs["a"].table[:3]
    assert max_rel_error(d, tiny.hf) < TOL


def test_recompute_after_preemption_matches_transformers(
    tiny_models: dict[str, TinyModel],
) -> None:
    tiny = tiny_models["v2_lite"]
    d = Driver(load_runner(tiny.path, block_size=4))
    p0, p1 = _prompts([9, 6], seed=3)
    d.add("x", p0)
    d.add("y", p1)
    d.step({"x": 9, "y": 6})
    d.decode_all(3)
    old_table = list(d.seqs["x"].table)
    d.preempt("x")  # state dropped; x comes back with a fresh block table
    d.step({"y": 1})
    d.step({"x": 8, "y": 1})  # recompute prompt + outputs in two chunks
    d.step({"x": len(d.seqs["x"].tokens) - 8, "y": 1})
    d.decode_all(3)
    assert not set(d.seqs["x"].table) & set(old_table)
    assert max_rel_error(d, tiny.hf) < TOL


def test_greedy_generation_is_token_identical_to_transformers_generate(tiny: TinyModel) -> None:
    prompts = _prompts([6, 10], seed=4)
    d = Driver(load_runner(tiny.path, block_size=4))
    for i, p in enumerate(prompts):
        d.add(f"g{i}", p)
    d.step({rid: len(s.tokens) for rid, s in d.seqs.items()})
    d.decode_all(31)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = tiny.hf.generate(
                torch.tensor([p]),
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert d.seqs[f"g{i}"].tokens == ref[0].tolist(), (tiny.name, i)


def test_absorbed_prefill_matches_transformers(tiny_models: dict[str, TinyModel]) -> None:
    """Forcing prompt chunks through the absorbed (decode) form gives the same logits."""
    tiny = tiny_models["v3_mtp"]
    runner = load_runner(tiny.path, block_size=4)
    runner.inputs.decode_max_query_len = 1 << 20
    d = Driver(runner)
    d.add("a", _prompts([13], seed=5)[0])
    d.step({"a": 6})
    d.step({"a": 7})
    d.decode_all(2)
    assert max_rel_error(d, tiny.hf) < TOL
