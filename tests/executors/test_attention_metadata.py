"""The paged attention metadata against its definition, request by request."""

from __future__ import annotations

import random

import pytest
import torch

from executors.attention import AttentionMetadata, build_attention_metadata
from executors.host_copy import PACK_ALIGN, packed_to_device
from executors.spec_chain import Shift, StepBuffers, rows_by_sequence


def _expected(query_lens, context_lens, tables, bs, nd):  # type: ignore[no-untyped-def]
    """Plain Python: a token at position p of request i lives in slot
    tables[i][p // bs] * bs + p % bs."""

    def slot(i: int, p: int) -> int:
        return tables[i][p // bs] * bs + p % bs

    slots = [
        slot(i, c + j) for i, (q, c) in enumerate(zip(query_lens, context_lens)) for j in range(q)
    ]
    kv = [
        slot(i, p) for i in range(nd, len(tables)) for p in range(context_lens[i] + query_lens[i])
    ]
    width = max((len(t) for t in tables), default=0) or 1
    padded = [t + [0] * (width - len(t)) for t in tables]
    seq = [c + q for q, c in zip(query_lens, context_lens)]
    cum = lambda xs: [sum(xs[:i]) for i in range(len(xs) + 1)]  # noqa: E731
    return {
        "slot_mapping": slots,
        "query_start_loc": cum(query_lens),
        "context_lens": context_lens,
        "seq_lens": seq,
        "block_tables": padded,
        "num_decode_tokens": sum(query_lens[:nd]),
        "prefill_cu_seqlens_q": cum(query_lens[nd:]),
        "prefill_cu_seqlens_k": cum(seq[nd:]),
        "prefill_kv_slots": kv,
        "prefill_max_query_len": max(query_lens[nd:], default=0),
    }


@pytest.mark.parametrize("seed", range(20))
def test_metadata_matches_its_definition(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16, 64])
    nd, npf = rng.randrange(0, 6), rng.randrange(0, 4)
    query_lens = [rng.randint(1, 6) for _ in range(nd)] + [rng.randint(1, 90) for _ in range(npf)]
    context_lens = [rng.randrange(0, 200) for _ in query_lens]
    pool = list(range(1000))
    rng.shuffle(pool)
    tables = []
    for q, c in zip(query_lens, context_lens):
        n = -(-(q + c) // bs) + rng.randrange(0, 3)  # a table may run past the tokens
        tables.append([pool.pop() for _ in range(n)])
    md = build_attention_metadata(query_lens, context_lens, tables, bs, nd, torch.device("cpu"))
    want = _expected(query_lens, context_lens, tables, bs, nd)
    for name, value in want.items():
        got = getattr(md, name)
        if isinstance(got, torch.Tensor):
            assert got.dtype == torch.int64, name
            got = got.tolist()
        assert got == value, name
    assert md.num_decode_reqs == nd and md.block_size == bs


def test_an_empty_batch_has_empty_metadata() -> None:
    md = build_attention_metadata([], [], [], 16, 0, torch.device("cpu"))
    assert md.slot_mapping.numel() == 0 and md.block_tables.shape == (0, 1)
    assert md.query_start_loc.tolist() == [0] and md.prefill_max_query_len == 0


def test_a_packed_copy_keeps_values_and_shapes_and_aligns_each_tensor() -> None:
    tensors = [
        torch.arange(5, dtype=torch.int64),
        torch.arange(12, dtype=torch.int64).view(3, 4),
        torch.zeros(0, dtype=torch.int64),
        torch.tensor([7], dtype=torch.int64),
    ]
    moved = packed_to_device(tensors, torch.device("cpu"))
    base = moved[0].data_ptr()
    for t, m in zip(tensors, moved):
        assert m.shape == t.shape and m.is_contiguous() and torch.equal(m, t)
        assert m.numel() == 0 or (m.data_ptr() - base) % (PACK_ALIGN * 8) == 0
    moved[0][0] = 99  # views of one buffer, none over another
    assert moved[1].flatten().tolist() == list(range(12)) and moved[3].item() == 7


@pytest.mark.gpu
def test_metadata_reaches_the_device_in_one_packed_copy() -> None:
    md = build_attention_metadata([1, 3], [9, 0], [[4], [5, 6]], 8, 1, torch.device("cpu"))
    extra = torch.arange(4, dtype=torch.int64)
    on_gpu, (moved,) = md.moved_with(torch.device("cuda"), [extra])
    assert torch.equal(moved.cpu(), extra)
    for name, value in vars(md).items():
        got = getattr(on_gpu, name)
        if isinstance(value, torch.Tensor):
            assert got.is_cuda and torch.equal(got.cpu(), value), name
            assert got.numel() == 0 or got.data_ptr() % 16 == 0, name  # (Triton's alignment)
        else:
            assert got == value, name


def test_a_shift_on_packed_views_equals_one_on_separate_tensors() -> None:
    """The chained verify step moves a loaded step's rows back in place (spec_chain.Shift):
    on the views of one packed copy it writes what it writes on separate tensors, and
    nothing outside each view."""
    md = build_attention_metadata([3, 3], [10, 20], [[4, 5], [6, 7, 9]], 8, 2, torch.device("cpu"))
    positions = torch.tensor([10, 11, 12, 20, 21, 22])
    ids = torch.arange(6)

    def shifted(md_, pos, ids_):  # type: ignore[no-untyped-def]
        buf = StepBuffers(ids_, pos, [md_.slot_mapping], md_.seq_lens, md_.context_lens,
                          md_.block_tables)  # fmt: skip
        Shift(torch.tensor([2, 1]), rows_by_sequence([3, 3]), 8).apply(buf)
        return [md_.slot_mapping, md_.seq_lens, md_.context_lens, md_.block_tables, pos, ids_]

    plain = shifted(
        AttentionMetadata(**{k: v.clone() if isinstance(v, torch.Tensor) else v
                             for k, v in vars(md).items()}),
        positions.clone(), ids.clone(),
    )  # fmt: skip
    fields = {k: v for k, v in vars(md).items() if isinstance(v, torch.Tensor)}
    moved = packed_to_device([*fields.values(), positions, ids], torch.device("cpu"))
    packed_md = AttentionMetadata(**{**vars(md), **dict(zip(fields, moved))})
    packed = shifted(packed_md, moved[-2], moved[-1])
    for a, b in zip(plain, packed):
        assert torch.equal(a, b)
    untouched = ("query_start_loc", "prefill_cu_seqlens_q", "prefill_cu_seqlens_k")
    for name in untouched:
        assert torch.equal(getattr(packed_md, name), getattr(md, name)), name
