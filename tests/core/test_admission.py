"""What a user reads when the scheduler limits or refuses a request: the exact
rejection reasons of `Scheduler.rejection_reason` and the warnings logged when
max_model_len is capped (`_effective_max_model_len`)."""

from __future__ import annotations

import logging

import pytest

from deepinfer.request import Request
from deepinfer.scheduler import Scheduler
from deepinfer.scheduler_checks import diagnose_stall
from tests.factories import make_config, make_request

CAP_BY_BUDGET = (
    "max_model_len capped at max_num_batched_tokens=16 (the model allows 100): without "
    "chunked prefill a longer prompt could never be scheduled"
)
CAP_BY_CACHE = (
    "max_model_len=1000 exceeds what one request can hold (KV cache of 10 blocks x 4 "
    "tokens, or the batch budget without chunked prefill); capping it at 40"
)


@pytest.mark.parametrize(
    ("chunked", "max_model_len", "model_max", "want_len", "warnings"),
    [
        # Without chunking the budget caps the model's limit: said once, as the budget.
        (False, None, 100, 16, [CAP_BY_BUDGET]),
        # A model limit exactly the budget is not capped: nothing to say.
        (False, None, 16, 16, []),
        # With chunking only the cache caps, and a model's limit is capped silently.
        (True, None, 100, 40, []),
        # A user's max_model_len past the cache is capped, and the user is told.
        (True, 1000, None, 40, [CAP_BY_CACHE]),
        # One exactly the cache's size fits: not a cap.
        (True, 40, None, 40, []),
        (True, 39, 100, 39, []),
    ],
)
def test_max_model_len_caps_are_logged_once_each_with_the_sizes(
    caplog: pytest.LogCaptureFixture,
    chunked: bool,
    max_model_len: int | None,
    model_max: int | None,
    want_len: int,
    warnings: list[str],
) -> None:
    cfg = make_config(
        block_size=4,
        num_gpu_blocks=10,
        max_num_batched_tokens=16,
        enable_chunked_prefill=chunked,
        max_model_len=max_model_len,
    )
    with caplog.at_level(logging.WARNING, logger="deepinfer.scheduler"):
        sched = Scheduler(cfg, 10, model_max_len=model_max)
    assert sched.max_model_len == want_len
    got = [r.getMessage() for r in caplog.records if r.name == "deepinfer.scheduler"]
    assert got == warnings


def test_rejection_reasons_name_the_sizes_exactly() -> None:
    sched = Scheduler(make_config(block_size=2, num_gpu_blocks=4, max_num_batched_tokens=16), 4)
    assert sched.add_request(make_request("e", [])) == (
        "empty prompt: at least one prompt token is needed"
    )
    # 9 prompt tokens + 1 output token = 10 tokens = 5 blocks of 2 (not 4 or 6).
    assert sched.add_request(make_request("big", 9)) == (
        "prompt of 9 tokens plus one output token needs 5 KV blocks of 2 tokens, but the "
        "whole cache holds 4 blocks (8 tokens)"
    )
    assert sched.add_request(make_request("fits", 7)) is None
    assert sched.num_rejected == 2 and list(sched.requests) == ["fits"]


@pytest.mark.parametrize(
    ("prompt", "reason"),
    [
        ([0, 9, 3], None),  # both ends of [0, 10) are in the vocabulary
        ([1, 10, 3], "prompt token id 10 is outside the vocabulary [0, 10)"),
        ([1, 2, -1], "prompt token id -1 is outside the vocabulary [0, 10)"),
    ],
)
def test_prompt_token_ids_outside_the_vocabulary_are_rejected(
    prompt: list[int], reason: str | None
) -> None:
    sched = Scheduler(make_config(), 10, vocab_size=10)
    assert sched.add_request(Request("r", prompt)) == reason


def test_diagnosis_of_a_waiting_head_that_holds_no_blocks() -> None:
    """`diagnose` (the text of SchedulerStalled) on a head of waiting never started."""
    sched = Scheduler(make_config(), 10)
    sched.add_request(make_request("a", 5))
    assert (
        "head of waiting: 'a' status waiting, 5 tokens, 0 computed, holds 0 blocks, needs 2"
        in diagnose_stall(sched)
    )
