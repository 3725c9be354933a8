"""KV handovers between two processes over gloo (executors/distributed/kv_link.py): a
prefill engine's process sends each request's prompt KV, a decode engine's process
imports it and decodes the tokens one colocated engine gives; a peer that dies mid
handover makes the receive raise rather than wait for good."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from executors.distributed.process_group import free_port
from tests.executors import kv_link_workers
from tests.executors.tiny_models import TinyModel


@pytest.mark.parametrize("kill_after_header", [False, True], ids=["served", "peer-killed"])
def test_1p1d_over_gloo_decodes_one_engines_tokens(
    tiny_models: dict[str, TinyModel], kill_after_header: bool
) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    args = (init, str(tiny_models["v3_plain"].path), kill_after_header)
    mp.spawn(kv_link_workers.run, args=args, nprocs=2, join=True)
