"""KV export and import between two torch executors (CPU): a request's prompt KV leaves
one cache as a contiguous tensor and fills other blocks of another, which then decodes
as the first would have; a request whose KV never arrived fails by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.config import EngineConfig
from deepinfer.errors import RequestFailed
from deepinfer.outputs import ScheduledRequest, SchedulerOutput
from deepinfer.request import Request
from executors.torch_executor import TorchExecutor
from tests.executors.harness import GREEDY
from tests.executors.tiny_models import TinyModel

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 10 tokens: blocks of 4, 4 and 2


def _executor(tiny: TinyModel, role: str, **kw) -> TorchExecutor:
    cfg = EngineConfig(block_size=4, num_gpu_blocks=16, role=role, **kw)
    return TorchExecutor(cfg, str(tiny.path), device="cpu", dtype="float32")


def _prefill(ex: TorchExecutor, table: list[int]) -> tuple[Request, int]:
    """PROMPT computed in `ex` under `table`; the request and its sampled token."""
    sr = ScheduledRequest(
        req_id="a", num_tokens=len(PROMPT), num_computed_tokens=0, is_prompt=True,
        will_sample=True, new_block_ids=list(table), block_table=list(table),
        token_ids=list(PROMPT), sampling_params=GREEDY, num_prompt_tokens=len(PROMPT),
    )  # fmt: skip
    out = ex.execute(SchedulerOutput(1, [sr]))
    return Request("a", PROMPT, GREEDY), out.sampled_token_ids["a"][0]


def _decode_start(table: list[int], num_cached_blocks: int = 0) -> SchedulerOutput:
    """A decode engine's first schedule of PROMPT: all but its last token computed."""
    n = len(PROMPT) - 1
    sr = ScheduledRequest(
        req_id="a", num_tokens=1, num_computed_tokens=n, is_prompt=False, will_sample=True,
        new_block_ids=list(table), block_table=list(table), token_ids=[PROMPT[n]],
        sampling_params=GREEDY, prior_token_ids=PROMPT[:n], num_prompt_tokens=len(PROMPT),
        num_cached_blocks=num_cached_blocks,
    )  # fmt: skip
    return SchedulerOutput(1, [sr])


@pytest.mark.parametrize("model", ["v3_plain", "v3_mtp"])
def test_imported_kv_decodes_as_the_exporting_executor_would(
    tiny_models: dict[str, TinyModel], model: str
) -> None:
    """The export is [tokens, layers (MTP's last), 576-style entry], with the hashes of
    its full blocks; imported into other block ids, the decode engine's first token is
    the prefill engine's, and its cache holds the same rows."""
    tiny = tiny_models[model]
    kw = dict(num_speculative_tokens=1) if model == "v3_mtp" else {}
    src, dst = _executor(tiny, "prefill", **kw), _executor(tiny, "decode", **kw)
    req, token = _prefill(src, [3, 9, 1])
    kv = src.export_kv(req, len(PROMPT) - 1)
    layers = src.kv_cache.layers + src.kv_cache.mtp_layers
    assert kv.kv.shape == (9, len(layers), src.config.kv_entry_dim)
    assert kv.num_bytes == kv.kv.nbytes and len(kv.block_hashes) == 2
    assert kv.block_hashes == tuple(req.block_hashes[:2])
    dst.import_kv(kv)
    out = dst.execute(_decode_start([7, 2, 12]))
    assert out.sampled_token_ids == {"a": [token]}
    for s, d in zip(layers, dst.kv_cache.layers + dst.kv_cache.mtp_layers):
        assert torch.equal(d[7], s[3]) and torch.equal(d[2], s[9])
        assert torch.equal(d[12, :1], s[1, :1])  # position 8; 9 was computed again
    assert dst.runner.kv_transfer.num_pending == 0


def test_blocks_cached_on_the_decode_engine_are_not_overwritten(
    tiny_models: dict[str, TinyModel],
) -> None:
    """A prefix-cache hit already holds its tokens' KV (other requests may read it): the
    import fills only the blocks after it."""
    tiny = tiny_models["v3_plain"]
    src, dst = _executor(tiny, "prefill"), _executor(tiny, "decode")
    req, token = _prefill(src, [0, 1, 2])
    dst.import_kv(src.export_kv(req, len(PROMPT) - 1))
    first = dst.kv_cache.layers[0][5].clone()  # block 5 plays the hit: left as it is
    dst.execute(_decode_start([5, 6, 8], num_cached_blocks=1))
    assert torch.equal(dst.kv_cache.layers[0][5], first)
    assert torch.equal(dst.kv_cache.layers[0][6], src.kv_cache.layers[0][1])
    assert dst.runner.kv_transfer.num_imported_tokens == len(PROMPT) - 1 - 4


def test_a_decode_request_whose_kv_never_arrived_fails_by_name(
    tiny_models: dict[str, TinyModel],
) -> None:
    """Never decoded from blocks nothing wrote: the step names the request (the engine
    aborts it with that reason); an import of another length fails the same way, and
    one that cannot be this cache's is refused when it is handed in."""
    tiny = tiny_models["v3_plain"]
    src, dst = _executor(tiny, "prefill"), _executor(tiny, "decode")
    with pytest.raises(RequestFailed, match="'a'.*prompt's KV never arrived"):
        dst.execute(_decode_start([7, 2, 12]))
    req, _ = _prefill(src, [0, 1, 2])
    short = src.export_kv(req, 8)
    dst.import_kv(short)
    with pytest.raises(RequestFailed, match="holds 8 tokens, the step counts 9"):
        dst.execute(_decode_start([7, 2, 12]))
    kv = src.export_kv(req, 9)
    with pytest.raises(ValueError, match="imported already"):
        dst.import_kv(kv)
    bad = dataclasses.replace(kv, req_id="b", kv=kv.kv[:, :1])
    with pytest.raises(ValueError, match=r"'b': imported KV of shape \(9, 1, 48\)"):
        dst.import_kv(bad)
    with pytest.raises(ValueError, match="in torch.float64"):
        dst.import_kv(dataclasses.replace(kv, req_id="c", kv=kv.kv.double()))
    with pytest.raises(ValueError, match="its role is not decode"):
        src.import_kv(kv)
    with pytest.raises(ValueError, match="holds no such request"):
        src.export_kv(Request("zz", PROMPT), 3)
    with pytest.raises(ValueError, match="only 10 of its tokens"):
        src.export_kv(req, 11)
