"""Plot a model_speed.py sweep: prefill and decode throughput beside roofline and HF.

    python -m benchmarks.plot_model_speed model_speed.json [--out benchmarks/model_speed.png]

Left: prefill tokens/s against tokens per step. Right: decode tokens/s against
batch size, one line per context length. Log scales; the roofline is dashed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullLocator  # noqa: E402


def plot(data: dict, out: Path) -> None:
    rows = data["rows"]
    fig, (pre, dec) = plt.subplots(1, 2, figsize=(12, 4.8))
    prefill = sorted((r for r in rows if r["kind"] == "prefill"), key=lambda r: r["tokens"])
    x = [r["tokens"] for r in prefill]
    pre.plot(x, [r["ours_tok_s"] for r in prefill], "o-", label="deepinfer")
    pre.plot(x, [r["roofline_tok_s"] for r in prefill], "k--", label="matmul roofline")
    hf = [(r["tokens"], r["hf_tok_s"]) for r in prefill if r.get("hf_tok_s")]
    if hf:
        pre.plot(*zip(*hf), "s-", label="HF transformers")
    pre.set(
        xscale="log",
        yscale="log",
        xlabel="tokens per prefill step (1k-token prompts)",
        ylabel="tokens / s",
        title="prefill",
    )
    pre.set_xticks(x, [f"{t // 1024}k" for t in x])
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    contexts = sorted({r["context"] for r in rows if r["kind"] == "decode"})
    for i, ctx in enumerate(contexts):
        dr = sorted(
            (r for r in rows if r["kind"] == "decode" and r["context"] == ctx),
            key=lambda r: r["batch"],
        )
        b = [r["batch"] for r in dr]
        c = colors[i % len(colors)]
        label = f"ctx {ctx // 1024}k"
        dec.plot(b, [r["ours_tok_s"] for r in dr], "o-", color=c, label=f"deepinfer, {label}")
        dec.plot(b, [r["roofline_tok_s"] for r in dr], "--", color=c, label=f"roofline, {label}")
        hf = [(r["batch"], r["hf_tok_s"]) for r in dr if r.get("hf_tok_s")]
        if hf:
            dec.plot(*zip(*hf), "s:", color=c, label=f"HF transformers, {label}")
        eager = [(r["batch"], r["eager_tok_s"]) for r in dr if r.get("eager_tok_s")]
        if eager:
            dec.plot(*zip(*eager), "^:", color=c, alpha=0.6, label=f"no CUDA graphs, {label}")
    dec.set(
        xscale="log", yscale="log", xlabel="decode batch size", ylabel="tokens / s", title="decode"
    )
    batches = sorted({r["batch"] for r in rows if r["kind"] == "decode"})
    dec.set_xticks(batches, [str(b) for b in batches])
    for ax in (pre, dec):
        ax.xaxis.set_minor_locator(NullLocator())  # only the measured sizes are labelled
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    model = data.get("model", "model")
    fig.suptitle(
        f"{model}, dummy weights, one GPU: copy {data['copy_bw'] / 1e12:.2f} TB/s, "
        f"bf16 matmul {data['matmul_flops'] / 1e12:.0f} TFLOP/s (measured)"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", type=Path)
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("model_speed.png"))
    args = p.parse_args()
    plot(json.loads(args.json.read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
