"""Session-scoped tiny checkpoints (built once, a few seconds in all)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.executors.batch_invariant_model import POW2_SPEC, POW2_TWO_LAYER_SPEC
from tests.executors.tiny_models import SPECS, TinyModel, save_tiny


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_models(tiny_root: Path) -> dict[str, TinyModel]:
    return {name: save_tiny(name, tiny_root) for name in SPECS}


@pytest.fixture(params=sorted(SPECS))
def tiny(request: pytest.FixtureRequest, tiny_models: dict[str, TinyModel]) -> TinyModel:
    return tiny_models[request.param]


@pytest.fixture(scope="session")
def pow2_model(tiny_root: Path) -> TinyModel:
    """Power-of-two MLA widths: a model batch-invariant mode's Triton kernels all take."""
    return save_tiny("pow2", tiny_root, spec=POW2_SPEC)


@pytest.fixture(scope="session")
def pow2_two_layer_model(tiny_root: Path) -> TinyModel:
    """pow2_model's widths in a dense layer and a MoE layer (for Triton's interpreter)."""
    return save_tiny("pow2_two_layer", tiny_root, spec=POW2_TWO_LAYER_SPEC)
