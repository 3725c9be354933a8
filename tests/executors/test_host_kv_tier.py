"""The torch executor's host KV tier (executors/host_kv_tier.py): a prefix HBM evicted is
copied to host memory and loaded back, bit for bit, so a prompt whose prefix came back
from the host samples what it would with the prefix computed in a large HBM; the copies
of one step obey the core's order (tiers.py: loads read before saves are written; a
block evicted and found again in one step is read from its save); a store, and tiers
built elsewhere, are refused by name."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine import EngineCore
from deepinfer.kv_cache.tiers import HBM, HOST, STORE, KVTiers, TierLRU
from deepinfer.outputs import KVLoad, KVSave, SchedulerOutput
from executors.host_kv_tier import HostKVTier
from executors.kv_cache import PagedKVCache
from executors.pending_saves import PendingSaves
from tests.executors.test_llm import prompts
from tests.executors.tiny_models import TinyModel

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=5)
# A's prompt (13 tokens: three full blocks of 4, the last token computed), then two prompts
# of 16 that push A's blocks out of an 8-block HBM, then A again.
A, B, C = prompts(45, [13, 16, 16])


def _run(llm: LLM, a: list[int] = A, b: list[int] = B, c: list[int] = C) -> list:
    return [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in (a, b, c, a)]


def _llm(tiny: TinyModel, num_gpu_blocks: int, host_gib: float, **kw) -> LLM:
    return LLM(
        str(tiny.path), device="cpu", dtype="float32", block_size=4,
        num_gpu_blocks=num_gpu_blocks, kv_host_cache_gib=host_gib, check_invariants=True, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("model", ["v3_plain", "v3_mtp"])
def test_a_prefix_loaded_back_from_host_samples_as_one_computed_in_a_large_hbm(
    tiny_models: dict[str, TinyModel], model: str
) -> None:
    """A's second run finds its three prefix blocks in host memory (evicted from the small
    HBM by B and C), not in HBM: the same tokens and the same logprobs, to the bit, as
    an engine whose HBM kept them; its prefill computes one token, not thirteen, as
    without the tier it would."""
    tiny = tiny_models[model]
    kw = dict(num_speculative_tokens=1) if model == "v3_mtp" else {}
    tiered = _llm(tiny, 8, 0.001, **kw)
    large = _llm(tiny, 64, 0.0, **kw)
    outs, ref = _run(tiered), _run(large)
    for got, want in zip(outs, ref):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs
    assert outs[3].num_cached_tokens == ref[3].num_cached_tokens == 12
    assert isinstance(tiered.engine, EngineCore) and isinstance(large.engine, EngineCore)
    hits = tiered.engine.scheduler.kv.prefix_hit_blocks
    assert hits[HOST] == 3 and hits[HBM] == 0
    assert large.engine.scheduler.kv.prefix_hit_blocks[HBM] == 3
    tier = tiered.executor.runner.host_tier
    assert tier.num_loaded == 3 and tier.num_saved >= 3
    if not kw:
        alone = _run(_llm(tiny, 8, 0.0))  # no tier: A's prefix is computed again
        assert alone[3].num_cached_tokens == 0
        assert alone[3].outputs[0].token_ids == ref[3].outputs[0].token_ids


def test_the_host_tier_is_sized_in_blocks_of_every_kv_layer(
    tiny_models: dict[str, TinyModel],
) -> None:
    """kv_host_cache_gib / (block_size x layers, the MTP layer's too, x entry x dtype):
    the core's host tier has the executor's slots."""
    tiny = tiny_models["v3_mtp"]
    llm = _llm(tiny, 8, 0.001, num_speculative_tokens=1)
    tier = llm.executor.runner.host_tier
    cfg = llm.executor.config
    per_block = 4 * (cfg.num_hidden_layers + 1) * cfg.kv_entry_dim * 4
    assert tier.block_bytes == per_block and tier.num_slots == (1 << 30) // 1000 // per_block
    assert isinstance(llm.engine, EngineCore)
    tiers = llm.engine.scheduler.kv.tiers
    assert tiers is not None and tiers.host is not None and tiers.store is None
    assert tiers.host.capacity == tier.num_slots


def _cache(num_blocks: int = 8) -> PagedKVCache:
    cache = PagedKVCache(2, num_blocks, 4, 6, torch.float32, torch.device("cpu"), num_mtp_layers=1)
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers + cache.mtp_layers:
        layer.copy_(torch.randn(layer.shape, generator=g))
    return cache


def _block(cache: PagedKVCache, block_id: int) -> list[torch.Tensor]:
    return [layer[block_id].clone() for layer in cache.layers + cache.mtp_layers]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _step(loads: list[KVLoad] = [], saves: list[KVSave] = []) -> SchedulerOutput:  # noqa: B006
    out = SchedulerOutput(1, [])
    out.kv_loads, out.kv_saves = tuple(loads), tuple(saves)
    return out


def test_one_steps_saves_read_hbm_before_its_loads_write_it() -> None:
    """Block 2 is saved and is the target of a load in the same step (the allocation that
    evicted it reuses it): the save holds its old content; the load's slot is read before
    the step's save into it (the core's read-before-write), and a block saved and found
    again in one step is read from the save."""
    cache = _cache()
    tier = HostKVTier(cache, 2)
    b2, b3, b5 = _block(cache, 2), _block(cache, 3), _block(cache, 5)
    tier.apply(_step(saves=[KVSave(HOST, 3, 30, 0)]))  # an earlier step: 30 in slot 0
    tier.apply(
        _step(
            loads=[KVLoad(HOST, 2, 30, 0), KVLoad(HOST, 6, 50, 1)],
            saves=[KVSave(HOST, 2, 20, 0), KVSave(HOST, 5, 50, 1)],
        )
    )
    assert _same(_block(cache, 2), b3)  # slot 0 as it was: 30, not this step's 20
    assert _same(_block(cache, 6), b5)  # 50: saved by this step, read from the save
    assert tier.num_loaded == 2 and tier.num_saved == 3
    tier.apply(_step(loads=[KVLoad(HOST, 7, 20, 0)]))
    assert _same(_block(cache, 7), b2)  # block 2's content before the load overwrote it


def test_a_slot_saved_twice_in_one_step_keeps_the_later() -> None:
    cache = _cache()
    tier = HostKVTier(cache, 1)
    b1 = _block(cache, 1)
    tier.apply(_step(saves=[KVSave(HOST, 0, 10, 0), KVSave(HOST, 1, 11, 0)]))
    tier.apply(_step(loads=[KVLoad(HOST, 4, 11, 0)]))
    assert _same(_block(cache, 4), b1)


def test_a_load_of_a_slot_never_written_fails_by_name() -> None:
    """A step scheduled and dropped before its launch never copied its saves: the slot
    does not hold what the core booked there, and the load says so instead of handing
    the step another block's KV."""
    tier = HostKVTier(_cache(), 2)
    with pytest.raises(RuntimeError, match="slot 1 does not hold block 0x63"):
        tier.apply(_step(loads=[KVLoad(HOST, 3, 99, 1)]))


class _Fence:
    """A save's fence as the tests drive it: done when they say."""

    def __init__(self) -> None:
        self.done = False


def test_a_read_of_a_slot_waits_only_for_the_save_still_writing_it() -> None:
    """The saves leave on a stream of their own: a load from a host slot waits for the
    last save queued into that slot while it is not done, for no other save, and for none
    once it is done."""
    pending: PendingSaves[_Fence] = PendingSaves(lambda f: f.done)
    first, second = _Fence(), _Fence()
    pending.saved([0, 1], first)
    pending.saved([1, 2], second)  # slot 1 again: its later save's fence covers both
    assert pending.fences([3]) == []  # never saved: nothing to wait for
    assert pending.fences([0]) == [first]
    assert pending.fences([1]) == [second]
    assert pending.fences([2, 0, 1]) == [second, first]  # each fence once, in read order
    first.done = True
    assert pending.fences([0, 1]) == [second]
    assert len(pending) == 2  # slot 0's done fence is forgotten once asked about
    second.done = True
    assert pending.fences([0, 1, 2]) == [] and len(pending) == 0


def test_a_store_is_refused_by_name(tiny_models: dict[str, TinyModel]) -> None:
    """The shared store is a simulator plan: tiers built for the torch executor elsewhere
    are refused when its engine is built, and a store copy by the tier itself."""
    with pytest.raises(ValueError, match="a KV store tier: the torch executor"):
        HostKVTier(_cache(), 2).apply(_step(loads=[KVLoad(STORE, 3, 9, 0)]))
    llm = _llm(tiny_models["v3_plain"], 8, 0.0)
    with pytest.raises(ValueError, match="a shared KV store: .*the store is a simulator plan"):
        EngineCore(llm.config, llm.executor, kv_tiers=KVTiers(None, TierLRU(STORE, 4)))


def test_a_host_tier_with_data_parallel_ranks_is_refused(
    tiny_models: dict[str, TinyModel],
) -> None:
    with pytest.raises(ValueError, match="kv_host_cache_gib=1 with data_parallel_size=2"):
        LLM(str(tiny_models["v3_plain"].path), device="cpu", dtype="float32",
            kv_host_cache_gib=1, data_parallel_size=2)  # fmt: skip


def _cuda_cache(num_blocks: int, num_mtp_layers: int = 0) -> PagedKVCache:
    """Moonlight's layers and entries (27 x 576, bf16) in blocks of 256 tokens: 8 MB a
    block, so that a save of a few dozen blocks takes the link milliseconds."""
    dev = torch.device("cuda")
    cache = PagedKVCache(27, num_blocks, 256, 576, torch.bfloat16, dev, False, num_mtp_layers)
    for layer in cache.layers + cache.mtp_layers:
        layer.normal_()
    return cache


@pytest.mark.gpu
@pytest.mark.parametrize("warm", [False, True])
def test_on_cuda_a_forward_does_not_wait_for_an_earlier_steps_saves_to_the_host(
    warm: bool,
) -> None:
    """Step 2 saves 64 blocks (510 MB: milliseconds over PCIe); step 3 loads a block saved
    long before and its forward overwrites step 2's blocks. The forward is done while step
    2's saves are still crossing the link (it waited for their gather only), and they reach
    the host as they were before it. Cold: the tier's first steps (its kernels were loaded
    by its construction); `warm`: the same two steps ran once before, so the allocators hold
    the buffers they need, as in a served engine after its first copies."""
    dev = torch.device("cuda")
    cache = _cuda_cache(66)
    tier = HostKVTier(cache, 65)
    assert tier.buffer.is_pinned() and tier.stream is not None and tier.save_stream is not None
    assert len({tier.stream, tier.save_stream, torch.cuda.current_stream(dev)}) == 3
    kept = _block(cache, 65)
    tier.apply(_step(saves=[KVSave(HOST, 65, 7, 64)]))
    if warm:
        tier.apply(_step(saves=[KVSave(HOST, b, 100 + b, b) for b in range(64)]))
        tier.apply(_step(loads=[KVLoad(HOST, 64, 7, 64)]))
    torch.cuda.synchronize()
    before = {b: _block(cache, b) for b in (0, 31, 63)}
    tier.apply(_step(saves=[KVSave(HOST, b, 100 + b, b) for b in range(64)]))
    saved = torch.cuda.Event()
    saved.record(tier.save_stream)
    tier.apply(_step(loads=[KVLoad(HOST, 64, 7, 64)]))  # no slot step 2 writes
    for layer in cache.layers:  # step 3's "forward": overwrites step 2's saved blocks
        layer[:64].zero_()
    forward = torch.cuda.Event()
    forward.record()
    forward.synchronize()
    assert not saved.query(), "the forward waited for the saves' way to the host"
    assert _same(_block(cache, 64), kept)
    torch.cuda.synchronize()
    for b, blocks in before.items():
        assert _same([tier.buffer[b, i].to(dev) for i in range(len(blocks))], blocks)


@pytest.mark.gpu
def test_on_cuda_back_to_back_saves_and_loads_of_one_slot_move_the_right_blocks() -> None:
    """With no synchronisation between the steps: a load of slots whose save is still
    crossing the link waits for it (and the compute stream's next work sees the loads), and
    a save into slots that loads still read waits for those loads."""
    cache = _cuda_cache(40, num_mtp_layers=1)
    tier = HostKVTier(cache, 16)
    before = [_block(cache, b) for b in range(16)]
    tier.apply(_step(saves=[KVSave(HOST, b, 100 + b, b) for b in range(16)]))
    for layer in cache.layers + cache.mtp_layers:  # the "forward": overwrites them
        layer[:16].zero_()
    tier.apply(_step(loads=[KVLoad(HOST, 16 + b, 100 + b, b) for b in range(16)]))
    # queued on the compute stream after the loads' event (read after the next steps)
    total = sum(layer[16:32].float().abs().sum() for layer in cache.layers + cache.mtp_layers)
    fresh = [_block(cache, 32 + b) for b in range(8)]
    tier.apply(_step(saves=[KVSave(HOST, 32 + b, 200 + b, b) for b in range(8)]))
    tier.apply(_step(loads=[KVLoad(HOST, b, 200 + b, b) for b in range(8)]))
    torch.cuda.synchronize()
    assert float(total) > 0
    for b in range(16):
        assert _same(_block(cache, 16 + b), before[b])
    for b in range(8):
        assert _same(_block(cache, b), fresh[b])


@pytest.mark.gpu
def test_on_cuda_a_prefix_from_host_gives_the_tokens_of_a_large_hbm(
    tiny_models: dict[str, TinyModel],
) -> None:
    """The tiny model end to end on the device, CUDA graphs and async scheduling on, blocks
    of 16: A's three prefix blocks come back from the host."""
    tiny = tiny_models["v3_plain"]
    a, b, c = prompts(46, [52, 64, 64])

    def llm(blocks: int, gib: float) -> LLM:
        return LLM(str(tiny.path), device="cuda", dtype="float32", block_size=16,
                   num_gpu_blocks=blocks, kv_host_cache_gib=gib)  # fmt: skip

    tiered = llm(8, 0.01)
    outs = _run(tiered, a, b, c)
    assert tiered.executor.runner.host_tier.num_loaded == 3
    assert outs[3].num_cached_tokens == 48
    tiered.shutdown()
    large = llm(64, 0.0)
    ref = _run(large, a, b, c)
    large.shutdown()
    for got, want in zip(outs, ref):  # (the loaded KV is the computed KV's bytes)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        g, w = got.outputs[0].cumulative_logprob, want.outputs[0].cumulative_logprob
        assert g is not None and w is not None and abs(g - w) < 1e-5


def test_saves_of_a_step_that_never_launched_still_reach_host_memory(
    tiny_models: dict[str, TinyModel],
) -> None:
    """Async scheduling: B's decode step fails while the step after it (C's prompt, with
    prompt logprobs: it cannot overlap, so it waits to launch) was scheduled evicting A's
    cached blocks to host memory. That step never launches, yet the tier holds A's blocks:
    their saves are copied as the engine drops the step, so A, and an unrelated prompt
    beside it, are served later (not aborted on a slot that holds nothing)."""
    from deepinfer.request import Request
    from executors.step_handle import PendingStep

    llm = _llm(tiny_models["v3_plain"], 10, 0.001, enable_prefix_caching=True,
               async_scheduling=True)  # fmt: skip
    engine, executor = llm.engine, llm.executor
    assert isinstance(engine, EngineCore)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    want = llm.generate([A], greedy, use_tqdm=False)[0].outputs[0].token_ids
    launch = executor.execute_async
    fail = {engine.scheduler.step_id + 2}  # B's first decode step

    def execute_async(out: SchedulerOutput):  # type: ignore[no-untyped-def]
        handle = launch(out)
        return PendingStep.failed(RuntimeError("injected")) if out.step_id in fail else handle

    executor.execute_async = execute_async  # type: ignore[method-assign]
    b = Request("B", prompts(7, [5])[0], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request(b)
    engine.step()
    c = Request("C", C + B, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1))
    engine.add_request(c)
    while engine.has_unfinished():
        engine.step()
    fail.clear()
    assert engine.scheduler.kv.tiers is not None and len(engine.scheduler.kv.tiers.host) > 0
    again = [Request("A2", A, greedy), Request("D", prompts(3, [5])[0], greedy)]
    for r in again:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()
    assert [r.status.value for r in again] == ["finished", "finished"], [
        r.reject_reason for r in again
    ]
    assert again[0].output_token_ids == want
