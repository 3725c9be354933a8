"""Kernel choice lives in kernels.ops alone: the models and the attention code call the
ops, carry no CPU copy of a kernel and never read DEEPINFER_KERNEL_BACKEND."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import executors
from executors.attention import build_attention_metadata
from executors.kv_cache import PagedKVCache
from kernels import ops
from tests.executors.harness import load_runner
from tests.executors.tiny_models import TinyModel

ROOT = Path(executors.__file__).parent
CALLERS = sorted((ROOT / "models").glob("*.py")) + [ROOT / "attention.py"]


@pytest.mark.parametrize("path", CALLERS, ids=lambda p: p.name)
def test_callers_leave_the_choice_to_ops(path: Path) -> None:
    source = path.read_text()
    for needle in ("kernel_backend", "backend=", "is_cuda", "use_triton", "kernels.reference"):
        assert needle not in source, f"{path.name} mentions {needle!r}"


def test_attention_keeps_metadata_only() -> None:
    from executors import attention

    assert not hasattr(attention, "mla_prefill_attention")
    assert not hasattr(attention, "mla_decode_attention")


OPS = ("rmsnorm", "fused_add_rmsnorm", "moe_router", "fused_moe", "mla_rope_cache",
       "mla_decode_attention", "mla_prefill_attention")  # fmt: skip


@torch.no_grad()
def test_forward_reaches_every_op_without_a_backend(
    tiny_models: dict[str, TinyModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step of a MoE model (a decode and a prefill request) runs every kernel through
    kernels.ops, on the CPU too (each op then runs its torch twin), and no caller passes
    a backend: ops reads DEEPINFER_KERNEL_BACKEND itself."""
    calls: dict[str, int] = dict.fromkeys(OPS, 0)
    for name in OPS:
        real = getattr(ops, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            assert "backend" not in kwargs, _name
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, spy)
    runner = load_runner(tiny_models["v3_mtp"].path)
    model, bs = runner.model, runner.block_size
    md = build_attention_metadata([1, 5], [3, 0], [[0], [1, 2]], bs, 1, torch.device("cpu"))
    ids = torch.tensor([7, 11, 12, 13, 14, 15])
    positions = torch.tensor([3, 0, 1, 2, 3, 4])
    cache = PagedKVCache(model.config.num_hidden_layers, 8, bs, model.config.kv_entry_dim,
                         torch.float32, torch.device("cpu"))  # fmt: skip
    model(ids, positions, md, cache.layers)
    assert all(calls.values()), calls
