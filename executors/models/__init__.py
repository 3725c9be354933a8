"""DeepSeek V2 / V3 in pure torch, over one flattened varlen batch and a paged latent cache.

- the validated config.json is deepinfer.model_config.ModelConfig (shared with the simulator).
- rope.py: default / YaRN frequencies, attention factor, softmax-scale mscale (RoPE itself: kernels.mla_rope_cache).
- layers.py: RMSNorm, the gated SiLU MLP.
- moe.py: router (softmax greedy / group-limited, sigmoid noaux_tc), fused experts, MoE.
- mla.py: multi-head latent attention (full form for prefill, absorbed form for decode).
- deepseek.py: decoder layer and DeepseekForCausalLM.
- mtp.py: the multi-token-prediction layers (checkpoint layers num_hidden_layers + k).
"""
