"""When a request stops on a token: EOS, stop token ids, max_tokens, max_model_len.

Stop strings need detokenized text and are checked by the output processor.
"""

from __future__ import annotations

from deepinfer.request import FinishReason, Request


def check_stop(req: Request, max_model_len: int) -> FinishReason | None:
    """The finish reason after `req`'s last appended token, or None to go on."""
    sp = req.sampling_params
    n = len(req.output_token_ids)
    last = req.output_token_ids[-1]
    if n >= sp.min_tokens:
        if not sp.ignore_eos and req.eos_token_id is not None and last == req.eos_token_id:
            return FinishReason.STOP
        if last in sp.stop_token_ids:
            return FinishReason.STOP
    if sp.max_tokens is not None and n >= sp.max_tokens:
        return FinishReason.LENGTH
    if req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
