"""What the front-end and a rank say to each other (plain picklable objects)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from deepinfer.data_parallel.request_sync import RequestDelta
from deepinfer.request import FinishReason, Request
from deepinfer.routing import InstanceLoad


@dataclass
class StepCommand:
    """Queue `adds`, end `finishes`, then run one step (every rank steps together)."""

    adds: list[Request] = field(default_factory=list)
    finishes: list[tuple[str, FinishReason]] = field(default_factory=list)


@dataclass
class StepReply:
    rank: int
    deltas: list[RequestDelta]
    load: InstanceLoad
    # prefix blocks the rank began (True) or ceased (False) to hold since its last reply
    cache_changes: dict[int, bool] = field(default_factory=dict)
    error: BaseException | None = None  # the step raised (the rank still kept lock-step)
    error_text: str = ""  # its traceback, formatted on the rank


@dataclass
class RankInfo:
    """Sent once by each rank when it is ready to serve."""

    rank: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_prompt_tokens: int  # the longest prompt the rank admits
    model_dir: Path
    vocab_size: int | None
    eos_token_id: int | list[int] | None


@dataclass
class Stop:
    """End the rank's loop (it shuts its executor down)."""


class RankClient(Protocol):
    """The front-end's end of one rank's connection (a multiprocessing Pipe fits)."""

    def send(self, obj: Any) -> None: ...

    def recv(self) -> Any: ...
