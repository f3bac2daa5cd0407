"""The two decoder families as workloads: the GPT-2 layout (`transformer`) and the modern layout
(`llama`) of the model in workloads/transformer.py, with what both share (the synthetic next-token task,
its loss, the analytic parameter, activation and FLOP counts) and each family's presets at published
dimensions.

The synthetic task: each sequence starts at a random token and follows a fixed permutation of the
vocabulary (next = perm[current]), except that with probability `noise` a token is replaced by a
random one. A model learns the permutation within a few dozen steps at the tiny size, so the loss
curve means something; the floor is set by the noise.
"""

from __future__ import annotations

import dataclasses
from typing import Any, final

import jax
import jax.numpy as jnp
from flax import nnx

from workloads.base import (
    LOSS_CHUNK,
    LOSS_CHUNK_MIN_LOGITS,
    ActivationProfile,
    Batch,
    BlockWrap,
    Workload,
    chunked_cross_entropy,
)
from workloads.transformer import CHECKPOINT_NAMES, Decoder, TransformerConfig, check_config, tensor_parallel_spec


def _gpt2(vocab: int, seq: int, d: int, layers: int, heads: int) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab, seq_len=seq, d_model=d, n_layers=layers, n_heads=heads,
                             n_kv_heads=heads, d_ff=4 * d)


def _modern(vocab: int, seq: int, d: int, layers: int, heads: int, kv_heads: int, d_ff: int, tied: bool,
            theta: float = 500000.0, rope_scaling: float = 1.0, context: int = 0) -> TransformerConfig:
    return TransformerConfig(vocab_size=vocab, seq_len=seq, d_model=d, n_layers=layers, n_heads=heads,
                             n_kv_heads=kv_heads, d_ff=d_ff, tied_embeddings=tied, norm="rmsnorm", mlp="swiglu",
                             positions="rope", bias=False, rope_theta=theta, rope_scaling=rope_scaling, context=context)


class DecoderWorkload(Workload):
    """What both decoder families share: the task, the loss, the analytic cost."""

    free_dimensions = tuple(f.name for f in dataclasses.fields(TransformerConfig))
    checkpoint_names = CHECKPOINT_NAMES
    tensor_parallel = True

    def tensor_parallel_spec(self, path: tuple[str, ...], shape: tuple[int, ...], shards: int,
                             axis: str) -> jax.sharding.PartitionSpec:
        return tensor_parallel_spec(path, shape, shards, axis)

    def build(self, cfg: TransformerConfig, *, dtype, block_wrap: BlockWrap, rngs: nnx.Rngs) -> Decoder:
        return Decoder(cfg, dtype=dtype, block_wrap=block_wrap, rngs=rngs)

    def check(self, cfg: TransformerConfig) -> TransformerConfig:
        return check_config(cfg)

    def follow(self, preset: TransformerConfig, overrides: dict[str, Any]) -> dict[str, Any]:
        """Dimensions that follow others when not given: attention heads stay full (not grouped)
        where the preset's are, and a GPT-2 MLP stays 4 x d_model."""
        extra = {}
        if "n_heads" in overrides and "n_kv_heads" not in overrides and preset.n_kv_heads == preset.n_heads:
            extra["n_kv_heads"] = overrides["n_heads"]
        if "d_model" in overrides and "d_ff" not in overrides and preset.d_ff == 4 * preset.d_model:
            extra["d_ff"] = 4 * overrides["d_model"]
        return extra

    def batch_shapes(self, cfg: TransformerConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {"tokens": jax.ShapeDtypeStruct((batch_size, cfg.seq_len + 1), jnp.int32)}

    def make_batch(self, cfg: TransformerConfig, key: jax.Array, batch_size: int) -> Batch:
        perm = jax.random.permutation(jax.random.key(20261129), cfg.vocab_size).astype(jnp.int32)
        k0, ku, kr = jax.random.split(key, 3)
        first = jax.random.randint(k0, (batch_size,), 0, cfg.vocab_size, dtype=jnp.int32)
        replace = jax.random.uniform(ku, (cfg.seq_len, batch_size)) < cfg.noise
        random_tokens = jax.random.randint(kr, (cfg.seq_len, batch_size), 0, cfg.vocab_size, dtype=jnp.int32)

        def follow(current, xs):
            rep, rnd = xs
            nxt = jnp.where(rep, rnd, perm[current])
            return nxt, nxt

        _, rest = jax.lax.scan(follow, first, (replace, random_tokens))  # (T, B)
        return {"tokens": jnp.concatenate([first[:, None], rest.T], axis=1)}

    def loss(self, model: Decoder, batch: Batch) -> jax.Array:
        tokens = batch["tokens"]
        return chunked_cross_entropy(model.hidden(tokens[:, :-1]), model.project, tokens[:, 1:])

    def param_count(self, cfg: TransformerConfig) -> int:
        d, f, kv, q = cfg.d_model, cfg.d_ff, cfg.n_kv_heads * cfg.head_dim, cfg.q_width
        norm = (2 if cfg.norm == "layernorm" else 1) * d
        attn = d * q + d * 2 * kv + q * d + (q + 2 * kv + d if cfg.bias else 0)
        up = (2 if cfg.gated else 1) * f
        mlp = d * up + f * d + (up + d if cfg.bias else 0)
        embeddings = cfg.vocab_size * d * (1 if cfg.tied_embeddings else 2)
        positions = cfg.seq_len * d if cfg.positions == "learned" else 0
        return embeddings + positions + cfg.n_layers * (2 * norm + attn + mlp) + norm

    def activation_profile(self, cfg: TransformerConfig) -> ActivationProfile:
        # Per layer, after Korthikanti et al. 2022 ("Reducing activation recomputation"), without
        # dropout masks: about 10 x T x D elements around attention and the norms, the MLP's hidden
        # activations (two, three with a gate), and with plain XLA attention the T x T scores and
        # probabilities per head (the fused kernel keeps none). The loss's float32 logits are live
        # one chunk at a time when it is chunked (workloads.base.chunked_cross_entropy).
        t, d = cfg.seq_len, cfg.d_model
        mlp = (3 if cfg.gated else 2) * cfg.d_ff
        scores = 2 * cfg.n_heads * t * t if cfg.attention == "xla" else 0
        chunked = t > LOSS_CHUNK and t * cfg.vocab_size >= LOSS_CHUNK_MIN_LOGITS
        kv, up, q = cfg.n_kv_heads * cfg.head_dim, (2 if cfg.gated else 1) * cfg.d_ff, cfg.q_width
        named = {"query_proj": t * q, "kv_proj": 2 * t * kv, "attention_out": t * q, "attention_proj": t * d,
                 "mlp_hidden": t * up, "mlp_out": t * d}
        return ActivationProfile(per_block=t * (10 * d + mlp) + scores, block_input=t * d,
                                 n_blocks=cfg.n_layers,
                                 head_fp32=(3 * LOSS_CHUNK * cfg.vocab_size if chunked else 1.5 * t * cfg.vocab_size),
                                 named=named)

    def forward_flops_by_part(self, cfg: TransformerConfig) -> dict[str, float]:
        t, d, kv, n, q = cfg.seq_len, cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.n_layers, cfg.q_width
        up = (2 if cfg.gated else 1) * cfg.d_ff
        return {"qkv": n * 2 * t * d * (q + 2 * kv), "attention": n * 4 * t * t * q,
                "attention_proj": n * 2 * t * q * d, "mlp": n * 2 * t * (d * up + cfg.d_ff * d)}

    def flops_per_example(self, cfg: TransformerConfig) -> float:
        # Per token: 6 x matmul parameters (blocks and the output projection), plus attention scores
        # and values, 12 * layers * d_model * seq_len (the PaLM paper's convention: the full T x T
        # product is counted, causal masking not subtracted).
        d, kv, q = cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.q_width
        mlp = (3 if cfg.gated else 2) * d * cfg.d_ff
        matmul_params = cfg.n_layers * (2 * d * q + 2 * d * kv + mlp) + cfg.vocab_size * d
        per_token = 6.0 * matmul_params + 12.0 * cfg.n_layers * q * cfg.seq_len
        return per_token * cfg.seq_len

    def tokens_per_example(self, cfg: TransformerConfig) -> int:
        return cfg.seq_len

    def matmul_width(self, cfg: TransformerConfig) -> int:
        return cfg.d_model


@final
class TransformerWorkload(DecoderWorkload):
    name = "transformer"
    description = "GPT-2-style decoder (LayerNorm, GELU MLP, learned positions, tied embeddings)"
    presets = {
        "tiny": _gpt2(256, 64, 64, 2, 4),
        # The guide's worked example is a 42M-parameter model.
        "small": _gpt2(32000, 512, 512, 8, 8),
        "gpt2-small": _gpt2(50257, 1024, 768, 12, 12),
        "gpt2-medium": _gpt2(50257, 1024, 1024, 24, 16),
        "gpt2-large": _gpt2(50257, 1024, 1280, 36, 20),
        "gpt2-xl": _gpt2(50257, 1024, 1600, 48, 25),
    }
    default_preset = "small"
    custom_base = "gpt2-small"


@final
class LlamaWorkload(DecoderWorkload):
    name = "llama"
    description = ("modern decoder (RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention); "
                   "presets with the published dimensions of Llama 3.2 1B and 3B and Llama 3.1 8B")
    presets = {
        "tiny": _modern(256, 64, 64, 2, 4, 2, 128, True, theta=10000.0),
        # Llama 3.2 scales rotary frequencies by 32, Llama 3.1 by 8 (low 1, high 4, original context
        # 8,192); both use RMSNorm epsilon 1e-5 and serve 131,072 tokens (max_position_embeddings in their
        # published configs). Trained here at 2,048 tokens a sequence.
        "1b": _modern(128256, 2048, 2048, 16, 32, 8, 8192, True, rope_scaling=32.0, context=131072),
        "3b": _modern(128256, 2048, 3072, 28, 24, 8, 8192, True, rope_scaling=32.0, context=131072),
        "8b": _modern(128256, 2048, 4096, 32, 32, 8, 14336, False, rope_scaling=8.0, context=131072),
    }
    default_preset = "tiny"
    custom_base = "8b"


WORKLOAD = TransformerWorkload()
LLAMA = LlamaWorkload()
