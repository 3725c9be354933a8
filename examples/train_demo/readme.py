"""README.md of the demo checkpoint, filled from the training run's report."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from . import COMMAND
from .checkpoint import parameter_counts
from .modeling import MODEL_CONFIG

_TEMPLATE = """\
# deepinfer-demo

A small DeepSeek-V3-architecture language model trained from scratch on the
Python standard library's own source code. It ships with deepinfer so that
tests, examples and benchmarks have a real trained checkpoint (real routing
statistics, a real MTP layer for speculative decoding) without a download. It
writes plausible-looking Python; it is not a useful code model.

## Architecture

`DeepseekV3ForCausalLM` (`model_type: deepseek_v3`), {params_main:,} parameters in
the main model ({params_embed:,} of them in the untied embedding and output head)
plus {params_mtp:,} in the MTP layer.

- layers: {num_hidden_layers} ({first_k_dense_replace} dense, then MoE) and one MTP layer
  (checkpoint index {num_hidden_layers}, `num_nextn_predict_layers: 1`)
- hidden size {hidden_size}, {num_attention_heads} heads
- MLA: q_lora_rank {q_lora_rank}, kv_lora_rank {kv_lora_rank}, qk_nope_head_dim
  {qk_nope_head_dim}, qk_rope_head_dim {qk_rope_head_dim}, v_head_dim {v_head_dim}
- dense MLP intermediate size {intermediate_size}
- MoE: {n_routed_experts} routed experts (top-{num_experts_per_tok}) and {n_shared_experts}
  shared, intermediate size {moe_intermediate_size}; sigmoid scores, noaux_tc routing with
  e_score_correction_bias, n_group {n_group} / topk_group {topk_group},
  routed_scaling_factor {routed_scaling_factor}
- RoPE (theta {rope_theta:g}, interleaved), max_position_embeddings {max_position_embeddings}
- vocabulary {vocab_size}: byte-level BPE with `<|bos|>` 0, `<|eos|>` 1, `<|pad|>` 2

`model.safetensors` ({file_mb:.1f} MB) is bf16 (the routers' e_score_correction_bias
float32) in DeepSeek's original names: per-expert `mlp.experts.{{e}}.gate_proj.weight`
etc., the MTP layer under `model.layers.{num_hidden_layers}.*` (`enorm`, `hnorm`,
`eh_proj`, the decoder block, `shared_head.norm`, and `shared_head.head`, a copy of
`lm_head`: the MTP layer shares the main model's embedding and output head, as in
the DeepSeek-V3 report). transformers' `DeepseekV3ForCausalLM.from_pretrained`
loads it (ignoring the MTP layer); deepinfer loads both.

## Data

The `*.py` files of the Python {python_version} standard library (site-packages,
test suites and generated files left out): {n_train_files} training files
({train_mb:.1f} MB, {train_tokens:,} tokens) and {n_heldout_files} held-out files
({heldout_mb:.1f} MB, {heldout_tokens:,} tokens), split by a hash of each file's
path (`examples/train_demo/corpus.py`). Each file is one document, `<|bos|> text <|eos|>`.
The tokenizer was trained on the training split only.

## Training

```
{command}
```

Seed {seed}, device {device} ({device_name}). {steps} steps of {batch_size} x {seq_len}
tokens ({tokens_seen:,} tokens seen, {epochs:.1f} epochs), {train_minutes:.1f} min of
training, {total_minutes:.1f} min in all (tokenizer and evaluation included).
AdamW (lr {lr:g}, betas 0.9/0.95, weight decay {weight_decay:g}), {warmup} warmup steps
then cosine decay to {min_lr:g} (the schedule also follows the time budget),
gradient clipping at 1.0, bf16 autocast on CUDA. Loss = main next-token loss +
{mtp_weight:g} x MTP loss (the MTP layer predicts the token after next from the main
model's final hidden state and the next token's embedding). Expert load balancing is
DeepSeek-V3's auxiliary-loss-free rule: after every step each router's
e_score_correction_bias moves by {bias_rate:g} x sign(mean load - expert load); no
auxiliary loss. (The report's rate, 0.001, is meant for runs of many thousands of
steps; in a short trial of this model at 0.01 the routers recovered from an early
collapse onto two experts within about 60 steps.)

Final train loss (main, mean of the last 20 steps): {final_train_loss:.3f}. Held-out
loss during training (first 16 held-out windows), by step: {curve}.

## Evaluation (held-out files, float32, the saved bf16 weights)

- held-out loss {heldout_loss:.3f} nats/token over {heldout_eval_tokens:,} tokens
- held-out perplexity {heldout_ppl:.2f}; uniform guessing over the vocabulary: {vocab_size}
- next-token top-1 accuracy {heldout_top1:.1%}
- MTP layer, top-1 accuracy on the token after next: {mtp_top1:.1%} (MTP loss {mtp_loss:.3f})
- expert load on held-out tokens, busiest expert / mean: {load_ratios}

Numbers are in `eval.json`; `heldout_sample.json` holds a few held-out files whose
loss `eval.json` records, so a test can re-score them on CPU.

## Licences

Training data: the Python standard library source, copyright Python Software
Foundation, under the PSF License Agreement (Python Software Foundation License
Version 2). The weights and tokenizer are released under the deepinfer project's
licence, {project_license}.
"""


def write_readme(out: Path, fields: dict) -> None:
    (out / "README.md").write_text(_TEMPLATE.format(**fields))


def fields(out: Path, report: dict, args: dict[str, Any], argv: list[str]) -> dict:
    """Template fields from eval.json's report, the run's arguments and the checkpoint."""
    cfg, data, ev = MODEL_CONFIG, report["data"], report["heldout"]
    run = ("steps", "batch_size", "seq_len", "tokens_seen", "epochs", "final_train_loss")
    hyper = ("seed", "lr", "min_lr", "weight_decay", "mtp_weight", "bias_rate", "device")
    return {
        **{k: v for k, v in cfg.items() if not isinstance(v, dict)},
        **parameter_counts(out),
        **{k: report[k] for k in run},
        **{k: args[k] for k in hyper},
        "rope_theta": cfg["rope_parameters"]["rope_theta"],
        "file_mb": report["checkpoint_bytes"] / 1e6,
        "python_version": data["python_version"],
        "n_train_files": data["train_files"],
        "n_heldout_files": data["heldout_files"],
        "train_mb": data["train_bytes"] / 1e6,
        "heldout_mb": data["heldout_bytes"] / 1e6,
        "train_tokens": data["train_tokens"],
        "heldout_tokens": data["heldout_tokens"],
        "command": COMMAND + " " + shlex.join(argv),
        "device_name": report["device_name"],
        "warmup": report["warmup_steps"],
        "train_minutes": report["train_seconds"] / 60,
        "total_minutes": report["total_seconds"] / 60,
        "heldout_loss": ev["loss"],
        "heldout_eval_tokens": ev["tokens"],
        "heldout_ppl": ev["perplexity"],
        "heldout_top1": ev["top1"],
        "mtp_top1": ev["mtp_top1"],
        "mtp_loss": ev["mtp_loss"],
        "project_license": "Apache-2.0 (see pyproject.toml)",
        "curve": ", ".join(f"{h['step']}: {h['heldout_loss']:.3f}" for h in report["history"])
        or "not measured",
        "load_ratios": ", ".join(
            f"{name} {max(f) * len(f):.2f}" for name, f in report["heldout_expert_load"].items()
        ),
    }
