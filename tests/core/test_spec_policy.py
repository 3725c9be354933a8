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


def test_the_batch_confidences_set_one_length_for_every_request() -> None:
    """A step verifies the same number of drafts for every request (its verify graph pads
    them to the longest anyway): confident batches draft more than unsure ones, and a
    request with fewer drafts verifies those it has."""

    def lengths(conf: list[float], batch: int) -> set[int]:
        return set(draft_lengths({f"r{i}": conf for i in range(batch)}, max_len=5).values())

    for batch in (8, 128, 256):
        (sure,) = lengths([0.95] * 5, batch)
        (unsure,) = lengths([0.4] * 5, batch)
        assert sure > unsure, batch
    mixed = {f"hi{i}": [0.95] * 5 for i in range(100)}
    mixed.update({f"lo{i}": [0.4] * 5 for i in range(100)})
    mixed["short"] = [0.99]
    got = draft_lengths(mixed, max_len=5)
    (common,) = {v for r, v in got.items() if r != "short"}
    assert got["short"] == 1
    (sure,) = lengths([0.95] * 5, 201)
    (unsure,) = lengths([0.4] * 5, 201)
    assert sure >= common >= unsure


def test_the_length_maximises_expected_tokens_per_step_cost() -> None:
    """Against brute force over every length: E(L) / (S + n(L)) is largest at the pick."""
    batch = {"a": [0.9, 0.8, 0.5], "b": [0.6, 0.6, 0.6], "c": [0.99, 0.2, 0.9]}
    for s in (1.0, 10.0, 100.0):

        def rate(length: int, s: float = s) -> float:
            e, n = 3.0, 3.0
            for conf in batch.values():
                c = 1.0
                for q in conf[:length]:
                    c *= q
                    e += c
                    n += 1
            return e / (s + n)

        pick = set(draft_lengths(batch, max_len=3, fixed_cost_tokens=s).values())
        assert pick == {max(range(4), key=rate)}, s
