"""The small trained DeepSeek-V3-architecture model that ships with deepinfer.

`executors/demo/deepinfer-demo/` holds the checkpoint (config.json, bf16
model.safetensors with one MTP layer, tokenizer.json, eval.json, README.md);
`python -m examples.train_demo.train --out DIR` (run from the repository root;
the training tool lives in examples/train_demo/, outside the engine) rebuilds it
from the Python standard library's source. Importing this package pulls in
neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_NAME = "deepinfer-demo"
DEMO_MODEL_DIR: Path = Path(__file__).resolve().parent / DEMO_MODEL_NAME


def demo_model_path() -> Path:
    """The shipped checkpoint directory; FileNotFoundError naming what is missing."""
    missing = [
        name
        for name in ("config.json", "model.safetensors", "tokenizer.json")
        if not (DEMO_MODEL_DIR / name).is_file()
    ]
    if missing:
        raise FileNotFoundError(
            f"the demo model checkpoint is not in {DEMO_MODEL_DIR} (missing {', '.join(missing)}); "
            "build it from the repository root with `python -m examples.train_demo.train --out "
            f"{DEMO_MODEL_DIR} --device cuda` (minutes on a GPU)"
        )
    return DEMO_MODEL_DIR
