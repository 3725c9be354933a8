"""Offline inference with the real executor: LLM(...).generate(prompts, SamplingParams(...)).

    python examples/offline_inference.py [--model DIR_OR_HUB_ID] [--device cpu|cuda]

Runs on the small DeepSeek-V3-architecture model that ships with deepinfer
(`deepinfer-demo`, trained on the Python standard library) by default, on the
CPU too.
"""

from __future__ import annotations

import argparse

from deepinfer import LLM, SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(root):",
    "class Stack:\n    def __init__(self):",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="deepinfer-demo")
    p.add_argument("--device", default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    llm = LLM(args.model, device=args.device, max_num_seqs=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens, seq_seed=0)
    for params in (greedy, sampled):
        print(f"=== temperature {params.temperature}")
        for out in llm.generate(PROMPTS, params):
            completion = out.outputs[0]
            print(
                f"--- {out.prompt!r} ({len(completion.token_ids)} tokens, "
                f"{completion.finish_reason})"
            )
            print(out.prompt + completion.text)


if __name__ == "__main__":
    main()
