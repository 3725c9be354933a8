"""The MTP module (checkpoint layer num_hidden_layers) reproduces transformers' MtpModel."""

from __future__ import annotations

import torch

from executors.attention import build_attention_metadata
from executors.kv_cache import PagedKVCache
from tests.executors.harness import load_runner
from tests.executors.tiny_models import TinyModel

TOL = 1e-4


@torch.no_grad()
def test_mtp_logits_match_transformers_through_the_paged_cache(
    tiny_models: dict[str, TinyModel],
) -> None:
    """Hidden states at t plus tokens t + 1 give logits for t + 2; run as a prefill chunk
    and then two single-token (absorbed) steps over the MTP layer's own cache."""
    tiny = tiny_models["v3_mtp"]
    model = load_runner(tiny.path).model
    assert model.mtp is not None
    cfg, bs = model.config, 4
    tokens = torch.randint(2, 256, (12,), generator=torch.Generator().manual_seed(0))
    hidden = tiny.hf.model(tokens[None]).last_hidden_state[0]  # [12, hidden]
    n = 11  # MTP inputs: hidden[t] with tokens[t + 1], t < 11
    ref = tiny.mtp._project_to_logits(
        tiny.mtp.forward_layer(
            0,
            hidden[None, :n],
            torch.arange(1, n + 1)[None],
            None,
            input_ids=tokens[None, 1 : n + 1],
        )
    )[0]  # [n, vocab]
    cache = PagedKVCache(1, 8, bs, cfg.kv_entry_dim, torch.float32, torch.device("cpu"))
    table = [[5, 2, 7]]  # non-contiguous blocks
    out = []
    for start, q in ((0, 9), (9, 1), (10, 1)):
        md = build_attention_metadata([q], [start], table, bs, int(q == 1), torch.device("cpu"))
        sl = slice(start, start + q)
        h = model.mtp(
            model,
            hidden[sl],
            tokens[start + 1 : start + q + 1],
            torch.arange(start, start + q),
            md,
            cache.layers[0],
        )
        out.append(model.mtp.compute_logits(model, h))
    logits = torch.cat(out)
    err = float((logits - ref).abs().max() / ref.abs().max())
    assert err < TOL, err


def test_checkpoint_without_mtp_tensors_loads_without_mtp(
    tiny_models: dict[str, TinyModel],
) -> None:
    """transformers' save_pretrained drops MTP layers: the model loads, MTP left out."""
    runner = load_runner(tiny_models["v3_plain"].path)
    assert runner.model.mtp is None
