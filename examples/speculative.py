"""Speculative decoding with the model's MTP layer: the same output, fewer steps.

    python examples/speculative.py [--model DIR] [--device cpu|cuda] [-k 3]

Generates greedily with and without `num_speculative_tokens` on the demo model
(one MTP layer, trained with the main model), checks that the text is identical,
and prints the acceptance per draft position and the steps and time each run took.
The same option works on the CLI: `deepinfer generate --num-speculative-tokens 3 ...`.
"""

from __future__ import annotations

import argparse
import time

from deepinfer import LLM, SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(root):",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):\n    ",
]


def run(model: str, device: str | None, k: int, max_tokens: int) -> tuple[list[str], LLM, float]:
    llm = LLM(model, device=device, num_speculative_tokens=k, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    start = time.perf_counter()
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].text for o in outs], llm, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="deepinfer-demo")
    p.add_argument("--device", default=None)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    plain, llm0, t0 = run(args.model, args.device, 0, args.max_tokens)
    spec, llm, t1 = run(args.model, args.device, args.num_speculative_tokens, args.max_tokens)
    assert spec == plain, "greedy speculative output differs from plain decoding"
    sched = llm.engine.scheduler
    per_position = [f"{a / n:.2f}" for n, a in sched.draft_position_stats if n]
    print(f"identical output for {len(PROMPTS)} prompts x {args.max_tokens} tokens")
    print(f"acceptance per draft position (given the earlier ones passed): {per_position}")
    print(
        f"drafts accepted {sched.num_accepted_drafts} of {sched.num_draft_tokens}; "
        f"steps {llm0.engine.scheduler.step_id} -> {sched.step_id}; "
        f"time {t0:.2f} s -> {t1:.2f} s"
    )
    print(PROMPTS[0] + spec[0])


if __name__ == "__main__":
    main()
