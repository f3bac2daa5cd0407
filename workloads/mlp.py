"""MLP classifier on MNIST-shaped (28x28) synthetic inputs."""

from __future__ import annotations

import dataclasses
from typing import final

import jax
import jax.numpy as jnp
from flax import nnx

from workloads.base import ActivationProfile, Batch, BlockWrap, Workload, cross_entropy, prototype_classification_batch


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    hidden: tuple[int, ...]
    image_size: int = 28
    num_classes: int = 10
    signal: float = 0.15  # class means ~6 noise standard deviations apart

    @property
    def in_features(self) -> int:
        return self.image_size * self.image_size

    @property
    def layer_sizes(self) -> list[tuple[int, int]]:
        dims = [self.in_features, *self.hidden, self.num_classes]
        return list(zip(dims[:-1], dims[1:]))


class _Block(nnx.Module):
    def __init__(self, fan_in: int, fan_out: int, *, dtype, rngs: nnx.Rngs):
        self.linear = nnx.Linear(fan_in, fan_out, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(self.linear(x))


class MLP(nnx.Module):
    def __init__(self, cfg: MLPConfig, *, dtype, block_wrap: BlockWrap, rngs: nnx.Rngs):
        sizes = cfg.layer_sizes
        self.blocks = nnx.List([_Block(i, o, dtype=dtype, rngs=rngs) for i, o in sizes[:-1]])
        self.head = nnx.Linear(*sizes[-1], dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.dtype = dtype
        self.block_call = block_wrap(_Block.__call__)

    def __call__(self, x: jax.Array) -> jax.Array:  # (B, 28, 28) -> (B, classes)
        h = x.reshape(x.shape[0], -1).astype(self.dtype)
        for block in self.blocks:
            h = self.block_call(block, h)
        return self.head(h)


@final
class MLPWorkload(Workload):
    name = "mlp"
    description = "MLP classifier on 28x28 inputs (MNIST-shaped)"
    presets = {
        "tiny": MLPConfig(hidden=(128,)),
        "small": MLPConfig(hidden=(1024, 1024)),
        "large": MLPConfig(hidden=(4096, 4096, 4096, 4096)),
    }
    default_preset = "small"

    def build(self, cfg: MLPConfig, *, dtype, block_wrap: BlockWrap, rngs: nnx.Rngs) -> MLP:
        return MLP(cfg, dtype=dtype, block_wrap=block_wrap, rngs=rngs)

    def batch_shapes(self, cfg: MLPConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {
            "x": jax.ShapeDtypeStruct((batch_size, cfg.image_size, cfg.image_size), jnp.float32),
            "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        }

    def make_batch(self, cfg: MLPConfig, key: jax.Array, batch_size: int) -> Batch:
        shape = (cfg.image_size, cfg.image_size)
        return prototype_classification_batch(key, batch_size, shape, cfg.num_classes, cfg.signal)

    def loss(self, model: MLP, batch: Batch) -> jax.Array:
        return cross_entropy(model(batch["x"]), batch["label"])

    def param_count(self, cfg: MLPConfig) -> int:
        return sum(i * o + o for i, o in cfg.layer_sizes)

    def activation_profile(self, cfg: MLPConfig) -> ActivationProfile:
        widest = max(cfg.hidden)
        return ActivationProfile(per_block=2 * widest, block_input=widest, n_blocks=len(cfg.hidden),
                                 head_fp32=3 * cfg.num_classes + cfg.in_features)

    def flops_per_example(self, cfg: MLPConfig) -> float:
        # Per layer: the forward product and the weight gradient, 2 x in x out each, and the input
        # gradient except for the first layer (its input is the data: no gradient is needed).
        products = [2.0 * i * o for i, o in cfg.layer_sizes]
        return 3.0 * sum(products) - products[0]


WORKLOAD = MLPWorkload()
