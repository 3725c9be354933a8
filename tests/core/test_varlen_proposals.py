"""How many drafts varlen asks the drafter for (DraftPlan.plan_proposals): no step of
prompts alone lowers it."""

from __future__ import annotations

from tests.core.test_spec_policy import ConfidentExecutor, _shape, _varlen_engine
from tests.factories import make_request


def test_a_request_after_a_long_prompt_verifies_the_length_its_engine_settled_on() -> None:
    """3 drafts pay best (10 / 12 / 14 / 16 ms for 0-3). One request decodes until the
    engine verifies 3 a step; the next arrives alone with a prompt of five steps' tokens.
    Its first decode step verifies 3 drafts: steps of prompts alone choose no length,
    so the proposals still follow the last decode steps'. When each prompt step counted
    as a length of 0, the drafter proposed 1 draft and the request climbed back one
    length per probe step."""
    ms = {0: 10.0, 1: 12.0, 2: 14.0, 3: 16.0}
    ex = ConfidentExecutor(1024, 3, 0.9)
    engine = _varlen_engine(ex)
    engine.add_request(make_request("first", 4, max_tokens=120))
    verified: list[int] = []
    while engine.has_unfinished():
        out = engine.schedule()
        res = ex.execute(out)
        longest, uniform = _shape(out)
        if not any(sr.is_prompt for sr in out.scheduled) and "second" in engine.scheduler.requests:
            verified.append(longest)
        engine.process(out, res, ms[longest] / 1e3 if uniform else 0.02)
        if not engine.has_unfinished() and not verified:
            engine.add_request(make_request("second", 5 * 256, max_tokens=40))
    assert verified[:3] == [3, 3, 3], verified
