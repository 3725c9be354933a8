"""Errors the engine raises to users."""

from __future__ import annotations


class SchedulerStalled(RuntimeError):
    """Work is pending, nothing can be scheduled and nothing is running.

    The message is a diagnosis: the request at the head of the queue, the
    blocks it holds and needs, cache usage and the prefill watermark.
    """


class RequestFailed(RuntimeError):
    """An executor could not run some requests' work in a step.

    `reasons` maps each failing request id to why. The engine aborts those requests
    with their reason, requeues the step's other requests for recompute, and goes on.
    """

    def __init__(self, reasons: dict[str, str]) -> None:
        super().__init__("; ".join(f"request {rid!r}: {why}" for rid, why in reasons.items()))
        self.reasons = dict(reasons)
