"""GPT-style decoder-only language model with causal self-attention, on a synthetic token task.

The synthetic task: each sequence starts at a random token and follows a fixed permutation of the
vocabulary (next = perm[current]), except that with probability `noise` a token is replaced by a
random one. A model learns the permutation within a few dozen steps at the tiny size, so the loss
curve means something; the floor is set by the noise.

Sizes follow GPT-2 (tied input/output embedding, learned positions, pre-LayerNorm blocks, 4x MLP).
"""

from __future__ import annotations

import dataclasses
import math
from typing import final

import jax
import jax.numpy as jnp
from flax import nnx

from workloads.base import ActivationProfile, Batch, BlockWrap, Workload, cross_entropy


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    mlp_ratio: int = 4
    noise: float = 0.05
    attention: str = "xla"  # "xla": plain einsum attention; "cudnn": jax.nn's fused kernel (GPU only)

    @property
    def d_ff(self) -> int:
        return self.mlp_ratio * self.d_model


_init = nnx.initializers.normal(stddev=0.02)


class _Attention(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        d = cfg.d_model
        out_init = nnx.initializers.normal(stddev=0.02 / math.sqrt(2 * cfg.n_layers))
        self.qkv = nnx.Linear(d, 3 * d, kernel_init=_init, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.out = nnx.Linear(d, d, kernel_init=out_init, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.n_heads = cfg.n_heads
        self.implementation = cfg.attention

    def __call__(self, x: jax.Array) -> jax.Array:  # (B, T, D)
        b, t, d = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.n_heads, d // self.n_heads)  # (B, T, 3, H, Dh)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        if self.implementation == "cudnn":  # fused kernel, NVIDIA GPUs only
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        else:
            y = _causal_attention(q, k, v)
        return self.out(y.reshape(b, t, d))


def _causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Plain XLA attention: scores in the compute dtype, softmax in float32. Runs on every backend
    (the CPU backend rejects fp16 matmuls with float32 accumulation, which jax.nn's version asks for)."""
    t, dh = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(dh).astype(q.dtype)  # (B, H, T, T)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)  # (B, T, H, Dh)


class _Block(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        d = cfg.d_model
        out_init = nnx.initializers.normal(stddev=0.02 / math.sqrt(2 * cfg.n_layers))
        self.ln1 = nnx.LayerNorm(d, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.attn = _Attention(cfg, dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.fc = nnx.Linear(d, cfg.d_ff, kernel_init=_init, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.proj = nnx.Linear(cfg.d_ff, d, kernel_init=out_init, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # (B, T, D) -> (B, T, D)
        x = x + self.attn(self.ln1(x))
        return x + self.proj(jax.nn.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, dtype, block_wrap: BlockWrap, rngs: nnx.Rngs):
        self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_init, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.wpe = nnx.Embed(cfg.seq_len, cfg.d_model, embedding_init=_init, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.blocks = nnx.List([_Block(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.block_call = block_wrap(_Block.__call__)

    def __call__(self, tokens: jax.Array) -> jax.Array:  # (B, T) int32 -> (B, T, V) logits
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = self.block_call(block, x)
        return self.wte.attend(self.ln_f(x))  # tied output embedding


@final
class TransformerWorkload(Workload):
    name = "transformer"
    description = "GPT-style decoder language model (causal attention, GPT-2 layout)"
    presets = {
        "tiny": TransformerConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=2, n_heads=4),
        # The guide's worked example is a 42M-parameter model.
        "small": TransformerConfig(vocab_size=32000, seq_len=512, d_model=512, n_layers=8, n_heads=8),
        "gpt2-small": TransformerConfig(vocab_size=50257, seq_len=1024, d_model=768, n_layers=12, n_heads=12),
        "gpt2-medium": TransformerConfig(vocab_size=50257, seq_len=1024, d_model=1024, n_layers=24, n_heads=16),
    }
    default_preset = "small"

    def build(self, cfg: TransformerConfig, *, dtype, block_wrap: BlockWrap, rngs: nnx.Rngs) -> GPT:
        return GPT(cfg, dtype=dtype, block_wrap=block_wrap, rngs=rngs)

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

    def loss(self, model: GPT, batch: Batch) -> jax.Array:
        tokens = batch["tokens"]
        return cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])

    def param_count(self, cfg: TransformerConfig) -> int:
        d = cfg.d_model
        per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * cfg.d_ff + cfg.d_ff) + (cfg.d_ff * d + d)
        return cfg.vocab_size * d + cfg.seq_len * d + cfg.n_layers * per_block + 2 * d

    def activation_profile(self, cfg: TransformerConfig) -> ActivationProfile:
        # Per layer, after Korthikanti et al. 2022 ("Reducing activation recomputation"), without
        # dropout masks: ~16 x T x D elements plus the T x T scores and probabilities per head.
        t, d = cfg.seq_len, cfg.d_model
        return ActivationProfile(per_block=16 * t * d + 2 * cfg.n_heads * t * t, block_input=t * d,
                                 n_blocks=cfg.n_layers, head_fp32=1.5 * t * cfg.vocab_size)

    def flops_per_example(self, cfg: TransformerConfig) -> float:
        # Per token: 6 x matmul parameters (blocks + the tied output projection), plus attention
        # scores and values, 12 * layers * d_model * seq_len (the PaLM paper's convention: the full
        # T x T product is counted, causal masking not subtracted).
        d = cfg.d_model
        matmul_params = cfg.n_layers * (4 * d * d + 2 * d * cfg.d_ff) + cfg.vocab_size * d
        per_token = 6.0 * matmul_params + 12.0 * cfg.n_layers * d * cfg.seq_len
        return per_token * cfg.seq_len

    def tokens_per_example(self, cfg: TransformerConfig) -> int:
        return cfg.seq_len


WORKLOAD = TransformerWorkload()
