"""Text for SimExecutor's tokens, and the output processor's stop strings over it.

The engine core never sees text: stop strings are the output processor's
(deepinfer/output_processor.py), which detokenizes each update's tokens one by one and
has the engine finish the request on the token that completes one (docs/design.md,
"Stop conditions"). To reach that path without a model, each simulated token has a
short text from a fixed vocabulary (`sim_text`, a function of the token alone), a
`SimTokenizer` decodes with it, and `TextStops` ends requests as `LLM._run` does.
"""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer.data_parallel.front_end import DataParallelEngine
from deepinfer.detokenizer import IncrementalDetokenizer
from deepinfer.engine import EngineCore
from deepinfer.output_processor import TrackedCompletion
from deepinfer.request import FinishReason, Request

# Short pieces that overlap often, so stop strings span token boundaries.
SIM_WORDS = ("a", "b", "ab", " ", "ba", "c", "\n", "abc", "bc ")


def sim_text(token: int) -> str:
    """The text of simulated token `token`."""
    return SIM_WORDS[token % len(SIM_WORDS)]


class SimTokenizer:
    """Decodes simulated tokens (no special tokens, every token a whole character run)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(sim_text(t) for t in ids)


class TextStops:
    """Each tracked request's completion, detokenized after every update; a stop string
    found ends the request from outside with reason stop, as `LLM._run` does."""

    def __init__(self) -> None:
        self.completions: dict[str, TrackedCompletion] = {}

    def track(self, req: Request) -> None:
        sp = req.sampling_params
        if not sp.stop or req.request_id in self.completions:
            return
        detok = IncrementalDetokenizer(
            SimTokenizer(), list(req.prompt), stop=list(sp.stop), min_tokens=sp.min_tokens
        )
        self.completions[req.request_id] = TrackedCompletion(req, 0, detok)

    def after_update(
        self, engine: EngineCore | DataParallelEngine, changed: Iterable[Request]
    ) -> tuple[set[str], set[str]]:
        """Feed the requests an update changed. Returns the ones a stop string ended:
        (those the update left live, then finished; those the update ended on a later
        token, their end moved back to the stop string's)."""
        finished, restated = set(), set()
        for req in changed:
            c = self.completions.get(req.request_id)
            if c is None or not c.feed():
                continue
            if not req.is_finished:
                engine.finish(req.request_id, FinishReason.STOP)
                finished.add(req.request_id)
            else:  # the data-parallel front-end keeps no records
                if isinstance(engine, EngineCore):
                    engine.restate_record(req)
                restated.add(req.request_id)
        return finished, restated
