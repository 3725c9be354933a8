"""Errors the engine raises to users."""

from __future__ import annotations


class SchedulerStalled(RuntimeError):
    """Work is pending, nothing can be scheduled and nothing is running.

    The message is a diagnosis: the request at the head of the queue, the
    blocks it holds and needs, cache usage and the prefill watermark.
    """
