"""The MoE decoder's analytic counts (workloads/moe.py): its parameters, total and per token, and the FLOPs of
each part of its forward pass, from the config alone (the compiled program is the check on them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workloads.moe import MoeConfig


def attention_params(cfg: MoeConfig) -> int:
    """One layer's attention weights: grouped-query, or MLA's compressed queries, keys and values."""
    d, h = cfg.d_model, cfg.n_heads
    if cfg.attention_type == "mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = (d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * qk) if cfg.q_lora_rank else d * h * qk
        kv = (d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
              + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        return q + kv + h * cfg.v_head_dim * d
    kv = cfg.n_kv_heads * cfg.head_dim
    return d * cfg.q_width + d * 2 * kv + cfg.q_width * d


def mlp_params(cfg: MoeConfig, width: int) -> int:
    """One MLP (or expert) `width` wide: two or three (gated) d_model x width matrices."""
    return (3 if cfg.gated else 2) * cfg.d_model * width


def parameter_counts(cfg: MoeConfig) -> tuple[int, int]:
    """(total, active per token) parameters."""
    d = cfg.d_model
    norms = 2 * d
    attn = attention_params(cfg)
    dense = attn + norms + mlp_params(cfg, cfg.d_ff)
    shared = mlp_params(cfg, cfg.n_shared_experts * cfg.expert_width) if cfg.n_shared_experts else 0
    expert = mlp_params(cfg, cfg.expert_width)
    moe_common = attn + norms + shared + d * cfg.n_experts
    embeddings = cfg.vocab_size * d * (1 if cfg.tied_embeddings else 2) + d
    total = embeddings + cfg.n_dense_layers * dense + cfg.n_moe_layers * (moe_common + cfg.n_experts * expert)
    active = embeddings + cfg.n_dense_layers * dense + cfg.n_moe_layers * (moe_common + cfg.top_k * expert)
    return total, active


def forward_flops_by_part(cfg: MoeConfig) -> dict[str, float]:
    """One sequence's forward FLOPs by part: projections, attention over T x T, attention output, MLPs
    (dense layers, shared experts and k routed ones), router."""
    t, d = cfg.seq_len, cfg.d_model
    n = cfg.n_layers
    attn_params = attention_params(cfg)
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim if cfg.attention_type == "mla" else cfg.head_dim
    v = cfg.v_head_dim if cfg.attention_type == "mla" else cfg.head_dim
    dense_mlp = mlp_params(cfg, cfg.d_ff)
    expert = mlp_params(cfg, cfg.expert_width)
    shared = mlp_params(cfg, cfg.n_shared_experts * cfg.expert_width) if cfg.n_shared_experts else 0
    proj = cfg.attention_width * d
    return {"qkv": n * 2 * t * (attn_params - proj), "attention": n * 2 * t * t * cfg.n_heads * (qk + v),
            "attention_proj": n * 2 * t * proj,
            "mlp": 2 * t * (cfg.n_dense_layers * dense_mlp + cfg.n_moe_layers * (shared + cfg.top_k * expert)),
            "router": cfg.n_moe_layers * 2 * t * d * cfg.n_experts}
