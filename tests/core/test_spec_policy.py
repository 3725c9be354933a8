"""Confidence-scheduled draft lengths (deepinfer/spec_policy.py)."""

from __future__ import annotations

from deepinfer.spec_policy import draft_lengths


def test_a_lone_request_drafts_while_its_drafts_are_likely() -> None:
    """Batch 1: the step is memory-bound, so any draft with a fair chance pays."""
    assert draft_lengths({"a": [0.9, 0.9, 0.8, 0.7, 0.6]}, max_len=5) == {"a": 5}
    assert draft_lengths({"a": [0.9, 0.9, 0.8, 0.7, 0.6]}, max_len=3) == {"a": 3}
    # A draft the drafter barely believes in is not worth even a free slot's risk...
    assert draft_lengths({"a": [0.9, 0.001, 0.9]}, max_len=5, fixed_cost_tokens=100) == {"a": 1}
    assert draft_lengths({"a": []}, max_len=5) == {"a": 0}


def test_the_verify_budget_shrinks_as_the_batch_grows() -> None:
    """The same confident drafts: all verified at batch 1, fewer per request at 128,
    none at 4096 (the step is compute-bound: a draft costs what it might yield)."""
    conf = [0.8, 0.7, 0.7, 0.6, 0.6]

    def mean_len(batch: int) -> float:
        lengths = draft_lengths({f"r{i}": conf for i in range(batch)}, max_len=5)
        return sum(lengths.values()) / batch

    assert mean_len(1) == 5
    assert 0 < mean_len(128) < mean_len(8) <= 5
    assert mean_len(4096) == 0


def test_confident_requests_get_the_budget_first() -> None:
    """Under load the drafts go where acceptance is likeliest; lengths are prefixes."""
    batch = {f"hi{i}": [0.95] * 5 for i in range(100)}
    batch.update({f"lo{i}": [0.4] * 5 for i in range(100)})
    lengths = draft_lengths(batch, max_len=5)
    assert min(lengths[f"hi{i}"] for i in range(100)) > max(lengths[f"lo{i}"] for i in range(100))
