"""Train the shipped demo model, from the repository root:

    python -m examples.train_demo.train --out DIR [--device cuda]

Builds the stdlib corpus and its BPE, trains DeepseekV3ForCausalLM plus its MTP
layer (loss = main + mtp_weight * MTP), saves the checkpoint in DeepSeek's layout,
reloads it in float32 and evaluates it on the held-out files (eval.json, README.md).
Seeded; `--minutes` caps the whole run (the LR schedule follows whichever of the
step count and the time budget runs out first, so a slower machine still anneals).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if not __package__:  # run as a file, where the relative imports below cannot work
    sys.exit(
        "run the demo model's training from the repository root: "
        "python -m examples.train_demo.train --out DIR [--device cuda]"
    )

import torch  # noqa: E402

from . import COMMAND, checkpoint, corpus, evaluate, modeling, readme  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=None, help="default: --epochs over the data")
    p.add_argument("--epochs", type=float, default=8.0)
    p.add_argument("--minutes", type=float, default=8.0, help="budget for the whole run")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument("--bias-rate", type=float, default=1e-2, help="aux-loss-free balancing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-mb", type=float, default=64.0, help="BPE training text cap")
    p.add_argument("--max-train-mb", type=float, default=None, help="corpus cap (smoke tests)")
    p.add_argument("--eval-windows", type=int, default=None, help="cap held-out windows")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--reserve-s", type=float, default=45.0, help="time kept for save + eval")
    return p.parse_args(argv)


def _cap(docs: list[corpus.Document], mb: float | None) -> list[corpus.Document]:
    if mb is None:
        return docs
    kept, used = [], 0
    for d in docs:
        if used + len(d.text.encode()) > mb * 1e6:
            continue
        kept.append(d)
        used += len(d.text.encode())
    return kept


def _lr(args: argparse.Namespace, step: int, warmup: int, progress: float) -> float:
    if step < warmup:
        return args.lr * (step + 1) / warmup
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.min_lr + (args.lr - args.min_lr) * cos


def _optimizer(params: list[torch.nn.Parameter], args: argparse.Namespace, cuda: bool):
    decay = [p for p in params if p.ndim >= 2]
    other = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": other, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=cuda)


@dataclass
class Data:
    tok: Any  # tokenizers.Tokenizer
    train_docs: list[corpus.Document]
    heldout_docs: list[corpus.Document]
    train: torch.Tensor  # [N] token stream, on the training device
    heldout: torch.Tensor  # [M] token stream, on the CPU


def prepare_data(args: argparse.Namespace, out: Path) -> Data:
    """Corpus split, tokenizer (saved to `out`) and both token streams."""
    train_docs, heldout_docs = corpus.split(corpus.stdlib_documents())
    train_docs = _cap(train_docs, args.max_train_mb)
    cfg = modeling.MODEL_CONFIG
    tok = corpus.train_tokenizer(train_docs, cfg["vocab_size"], int(args.tokenizer_mb * 1e6))
    corpus.save_tokenizer(tok, out, cfg["max_position_embeddings"])
    train = corpus.encode_documents(tok, train_docs).to(args.device)
    heldout = corpus.encode_documents(tok, heldout_docs)
    return Data(tok, train_docs, heldout_docs, train, heldout)


def train_loop(args: argparse.Namespace, data: Data, deadline: float) -> dict:
    """Train until the step count or the deadline; returns the models and run figures."""
    dev, cuda = args.device, args.device.startswith("cuda")
    model, mtp = modeling.build_models(args.seed)
    model.to(dev).train()
    mtp.to(dev).train()
    balancer = modeling.BiasBalancer(list(model.modules()) + list(mtp.modules()), args.bias_rate)
    params = [p for p in list(model.parameters()) + list(mtp.parameters()) if p.requires_grad]
    opt = _optimizer(params, args, cuda)
    tokens_per_step = args.batch_size * args.seq_len
    steps = args.steps or math.ceil(args.epochs * data.train.numel() / tokens_per_step)
    warmup = min(args.warmup, max(1, steps // 10))
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1, device=dev)
    history: list[dict] = []
    recent: list[float] = []
    t_train = time.time()
    step = 0
    while step < steps and time.time() < deadline:
        progress = max(step / steps, (time.time() - t_train) / max(deadline - t_train, 1e-9))
        lr = _lr(args, step, warmup, progress)
        for group in opt.param_groups:
            group["lr"] = lr
        high = data.train.numel() - args.seq_len - 1
        starts = torch.randint(0, high, (args.batch_size,), generator=gen).to(dev)
        batch = data.train[starts[:, None] + offsets]  # [B, T + 1]
        with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=cuda):
            loss, mtp_loss, _, _ = modeling.forward_losses(model, mtp, batch)
        opt.zero_grad(set_to_none=True)
        (loss + args.mtp_weight * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        imbalance = balancer.step()
        step += 1
        recent = (recent + [loss.item()])[-20:]
        if step % args.log_every == 0 or step == steps:
            elapsed = time.time() - t_train
            print(
                f"[train] step {step}/{steps} loss {loss.item():.3f} mtp {mtp_loss.item():.3f} "
                f"lr {lr:.2e} max/mean expert load {imbalance:.2f} "
                f"{step * tokens_per_step / elapsed:,.0f} tok/s {elapsed:.0f}s",
                flush=True,
            )
        if step % args.eval_every == 0:
            model.eval()
            mtp.eval()
            ev = evaluate.evaluate(
                model, mtp, data.heldout, args.seq_len, max_windows=16, device=dev, autocast=cuda
            )
            model.train()
            mtp.train()
            train_loss = sum(recent) / len(recent)
            history.append({"step": step, "train_loss": train_loss, "heldout_loss": ev["loss"]})
            print(f"[eval] step {step} held-out loss (16 windows) {ev['loss']:.3f}", flush=True)
    if cuda:
        torch.cuda.synchronize()
    return {
        "model": model,
        "mtp": mtp,
        "steps": step,
        "planned_steps": steps,
        "warmup_steps": warmup,
        "tokens_seen": step * tokens_per_step,
        "epochs": step * tokens_per_step / data.train.numel(),
        "train_seconds": time.time() - t_train,
        "final_train_loss": sum(recent) / max(len(recent), 1),
        "history": history,  # held-out loss on the first 16 windows, bf16 autocast on CUDA
    }


def train(args: argparse.Namespace, argv: list[str]) -> dict:
    """The whole run; returns eval.json's report."""
    t0 = time.time()
    deadline = t0 + 60 * args.minutes - args.reserve_s
    torch.manual_seed(args.seed)
    dev, cuda = args.device, args.device.startswith("cuda")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args, out)
    print(
        f"[data] {len(data.train_docs)} train files, {data.train.numel():,} tokens; "
        f"{len(data.heldout_docs)} held-out files, {data.heldout.numel():,} tokens; "
        f"{time.time() - t0:.1f}s",
        flush=True,
    )
    run = train_loop(args, data, deadline)
    file_bytes = checkpoint.save_checkpoint(run.pop("model"), run.pop("mtp"), out)

    # Evaluate what was saved: the bf16 checkpoint, reloaded in float32.
    model, mtp = checkpoint.load_for_eval(out, dev)
    with evaluate.expert_loads(model, mtp) as loads:
        ev = evaluate.evaluate(
            model, mtp, data.heldout, args.seq_len, max_windows=args.eval_windows, device=dev
        )
    sample_docs = evaluate.pick_sample(
        data.tok, data.heldout_docs, 6 * args.seq_len, 2 * args.seq_len
    )
    sample = evaluate.sample_loss(model, mtp, data.tok, sample_docs, args.seq_len, dev)
    files = [{"path": d.path, "text": d.text} for d in sample_docs]
    (out / "heldout_sample.json").write_text(
        json.dumps({"seq_len": args.seq_len, "files": files}, indent=1) + "\n"
    )
    report = {
        "heldout": ev,
        "heldout_sample": {"file": "heldout_sample.json", **sample},
        "heldout_expert_load": loads,
        "uniform_perplexity": modeling.MODEL_CONFIG["vocab_size"],
        **run,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "total_seconds": time.time() - t0,
        "checkpoint_bytes": file_bytes,
        "device_name": torch.cuda.get_device_name() if cuda else platform.machine() + " CPU",
        "data": {
            "python_version": platform.python_version(),
            "train_files": len(data.train_docs),
            "heldout_files": len(data.heldout_docs),
            "train_tokens": int(data.train.numel()),
            "heldout_tokens": int(data.heldout.numel()),
            "train_bytes": sum(len(d.text.encode()) for d in data.train_docs),
            "heldout_bytes": sum(len(d.text.encode()) for d in data.heldout_docs),
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    readme.write_readme(out, readme.fields(out, report, vars(args), argv))
    return report


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    report = train(parse_args(argv), argv)
    ev = report["heldout"]
    print(
        f"[done] {report['steps']} steps, {report['total_seconds']:.0f}s; held-out loss "
        f"{ev['loss']:.3f} ppl {ev['perplexity']:.2f} (uniform {report['uniform_perplexity']}),"
        f" MTP top-1 {ev['mtp_top1']:.1%}; checkpoint {report['checkpoint_bytes'] / 1e6:.1f} MB",
        flush=True,
    )


if __name__ == "__main__":
    main()
