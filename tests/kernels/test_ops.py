"""kernels.ops dispatches: Triton for CUDA tensors, the twin otherwise or when forced."""

from __future__ import annotations

import pytest
import torch

from kernels import ops


def test_cpu_tensors_take_the_twin() -> None:
    assert not ops.use_triton(torch.zeros(1), backend="auto")


def test_backend_argument_chooses() -> None:
    assert ops.use_triton(torch.zeros(1), backend="triton")
    assert not ops.use_triton(torch.zeros(1), backend="torch")


def test_unknown_backend_is_an_error() -> None:
    with pytest.raises(ValueError, match="kernel backend"):
        ops.use_triton(torch.zeros(1), backend="cuda")


def test_environment_variable_is_read_by_envs(monkeypatch) -> None:
    from deepinfer import envs

    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    assert envs.kernel_backend() == "torch"
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="DEEPINFER_KERNEL_BACKEND"):
        envs.kernel_backend()


def test_no_backend_argument_reads_the_environment(monkeypatch) -> None:
    """backend=None: kernels.ops reads DEEPINFER_KERNEL_BACKEND itself (callers pass nothing)."""
    cpu = torch.zeros(1)
    monkeypatch.delenv("DEEPINFER_KERNEL_BACKEND", raising=False)
    assert not ops.use_triton(cpu)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    assert ops.use_triton(cpu)
    assert not ops.use_triton(cpu, backend="torch")  # an explicit argument wins
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="DEEPINFER_KERNEL_BACKEND"):
        ops.use_triton(cpu)


@pytest.mark.gpu
def test_forced_twin_on_cuda() -> None:
    assert not ops.use_triton(torch.zeros(1, device="cuda"), backend="torch")
    assert ops.use_triton(torch.zeros(1, device="cuda"))


def test_ops_run_on_cpu_through_the_twins() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=gen)
    w = torch.rand(16, generator=gen) + 0.5
    normed, res = ops.fused_add_rmsnorm(x, x, w, 1e-6)
    assert torch.equal(res, 2 * x)
    assert torch.allclose(normed, ops.rmsnorm(2 * x, w, 1e-6))
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]])
    weights = torch.full((3, 2), 0.5)
    w13, w2 = torch.randn(3, 8, 16, generator=gen), torch.randn(3, 16, 4, generator=gen)
    assert ops.fused_moe(x, w13, w2, weights, ids).shape == (3, 16)
