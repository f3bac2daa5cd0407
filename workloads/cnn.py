"""ResNet-style CNN classifier on 32x32x3 synthetic images (CIFAR-shaped).

Normalisation under data parallelism: the train step is one `jax.jit` over a batch sharded along
the mesh's data axis, so BatchNorm's mean and variance are reduced over the *global* micro-batch,
across all devices (XLA inserts the cross-device reduction). That is what `pmap` code gets only
with `BatchNorm(axis_name=...)` ("sync BN"); `pmap` code without an axis name normalises each
device's shard on its own. Consequences: results do not depend on the number of devices (tested),
but do depend on the micro-batch size, so gradient accumulation with k micro-batches of b is not
identical to one batch of k*b for this workload (it is for the others).
"""

from __future__ import annotations

import dataclasses
from typing import final

import jax
import jax.numpy as jnp
from flax import nnx

from workloads.base import ActivationProfile, Batch, BlockWrap, Workload, cross_entropy


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    stage_widths: tuple[int, ...]
    blocks_per_stage: int
    image_size: int = 32
    channels: int = 3
    num_classes: int = 10
    signal: float = 0.8  # grating amplitude against unit pixel noise
    bn_momentum: float = 0.9

    def stages(self) -> list[tuple[int, int, int, int]]:
        """(in_channels, out_channels, stride, input_resolution) of every residual block."""
        out, res, cin = [], self.image_size, self.stage_widths[0]
        for s, width in enumerate(self.stage_widths):
            for b in range(self.blocks_per_stage):
                stride = 2 if (s > 0 and b == 0) else 1
                out.append((cin, width, stride, res))
                res //= stride
                cin = width
        return out


class _ResBlock(nnx.Module):
    def __init__(self, cin: int, cout: int, stride: int, cfg: CNNConfig, *, dtype, rngs: nnx.Rngs):
        conv = dict(use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        bn = dict(momentum=cfg.bn_momentum, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.conv1 = nnx.Conv(cin, cout, (3, 3), strides=stride, **conv)
        self.bn1 = nnx.BatchNorm(cout, **bn)
        self.conv2 = nnx.Conv(cout, cout, (3, 3), **conv)
        self.bn2 = nnx.BatchNorm(cout, **bn)
        self.shortcut = nnx.Conv(cin, cout, (1, 1), strides=stride, **conv) if (stride, cin) != (1, cout) else None
        self.shortcut_bn = nnx.BatchNorm(cout, **bn) if self.shortcut is not None else None

    def __call__(self, x: jax.Array) -> jax.Array:  # (B, H, W, Cin) -> (B, H/s, W/s, Cout)
        y = jax.nn.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        skip = x if self.shortcut is None else self.shortcut_bn(self.shortcut(x))
        return jax.nn.relu(y + skip)


class ResNet(nnx.Module):
    def __init__(self, cfg: CNNConfig, *, dtype, block_wrap: BlockWrap, rngs: nnx.Rngs):
        w0 = cfg.stage_widths[0]
        self.stem = nnx.Conv(cfg.channels, w0, (3, 3), use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.stem_bn = nnx.BatchNorm(w0, momentum=cfg.bn_momentum, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.blocks = nnx.List([_ResBlock(i, o, s, cfg, dtype=dtype, rngs=rngs) for i, o, s, _ in cfg.stages()])
        self.head = nnx.Linear(cfg.stage_widths[-1], cfg.num_classes, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.dtype = dtype
        self.block_call = block_wrap(_ResBlock.__call__)

    def __call__(self, x: jax.Array) -> jax.Array:  # (B, 32, 32, 3) -> (B, classes)
        h = jax.nn.relu(self.stem_bn(self.stem(x.astype(self.dtype))))
        for block in self.blocks:
            h = self.block_call(block, h)
        return self.head(h.mean(axis=(1, 2)))


@final
class CNNWorkload(Workload):
    name = "cnn"
    description = "ResNet-style classifier on 32x32x3 images (CIFAR-shaped), BatchNorm synced across devices"
    convolutional = True  # its products are convolutions, which JAX's dot remat policies never save
    presets = {
        "tiny": CNNConfig(stage_widths=(8, 16), blocks_per_stage=1),
        "small": CNNConfig(stage_widths=(32, 64, 128), blocks_per_stage=2),
        "resnet18": CNNConfig(stage_widths=(64, 128, 256, 512), blocks_per_stage=2),
    }
    default_preset = "small"

    def build(self, cfg: CNNConfig, *, dtype, block_wrap: BlockWrap, rngs: nnx.Rngs) -> ResNet:
        return ResNet(cfg, dtype=dtype, block_wrap=block_wrap, rngs=rngs)

    def batch_shapes(self, cfg: CNNConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {
            "x": jax.ShapeDtypeStruct((batch_size, cfg.image_size, cfg.image_size, cfg.channels), jnp.float32),
            "label": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        }

    def make_batch(self, cfg: CNNConfig, key: jax.Array, batch_size: int) -> Batch:
        # Each class is a coloured grating with its own orientation, frequency and colour, drawn at
        # a random phase under unit noise: translation-invariant features, as a CNN expects.
        k_label, k_phase, k_noise = jax.random.split(key, 3)
        k_class = jax.random.key(20261129)  # the classes themselves never change
        k_angle, k_freq, k_colour = jax.random.split(k_class, 3)
        angle = jax.random.uniform(k_angle, (cfg.num_classes,), maxval=jnp.pi)
        freq = jax.random.uniform(k_freq, (cfg.num_classes,), minval=1.0, maxval=4.0) / cfg.image_size
        colour = jax.random.normal(k_colour, (cfg.num_classes, cfg.channels))
        labels = jax.random.randint(k_label, (batch_size,), 0, cfg.num_classes, dtype=jnp.int32)
        phase = jax.random.uniform(k_phase, (batch_size, 1, 1), maxval=2 * jnp.pi)
        yy, xx = jnp.meshgrid(jnp.arange(cfg.image_size), jnp.arange(cfg.image_size), indexing="ij")
        a, f = angle[labels][:, None, None], freq[labels][:, None, None]
        wave = jnp.cos(2 * jnp.pi * f * (xx * jnp.cos(a) + yy * jnp.sin(a)) + phase)  # (B, H, W)
        shape = (batch_size, cfg.image_size, cfg.image_size, cfg.channels)
        x = cfg.signal * wave[..., None] * colour[labels][:, None, None, :] + jax.random.normal(k_noise, shape)
        return {"x": x.astype(jnp.float32), "label": labels}

    def loss(self, model: ResNet, batch: Batch) -> jax.Array:
        return cross_entropy(model(batch["x"]), batch["label"])

    def param_count(self, cfg: CNNConfig) -> int:
        w0 = cfg.stage_widths[0]
        total = 9 * cfg.channels * w0 + 2 * w0  # stem conv + BN scale/bias
        for cin, cout, stride, _ in cfg.stages():
            total += 9 * cin * cout + 9 * cout * cout + 4 * cout
            if (stride, cin) != (1, cout):
                total += cin * cout + 2 * cout
        return total + cfg.stage_widths[-1] * cfg.num_classes + cfg.num_classes

    def rows_per_example(self, cfg: CNNConfig) -> int:
        return cfg.image_size**2  # the first stage's convolutions, as implicit GEMMs over output pixels

    def activation_profile(self, cfg: CNNConfig) -> ActivationProfile:
        # conv, BN and ReLU outputs of both convolutions and the shortcut, at the largest stage
        sizes = [(res // stride) ** 2 * cout for _, cout, stride, res in cfg.stages()]
        stem = cfg.image_size**2 * cfg.stage_widths[0]
        return ActivationProfile(per_block=7 * max(sizes), block_input=max(sizes), n_blocks=len(sizes),
                                 head_fp32=3 * stem + cfg.image_size**2 * cfg.channels)

    def flops_per_example(self, cfg: CNNConfig) -> float:
        r = cfg.image_size
        fwd = 2.0 * r * r * 9 * cfg.channels * cfg.stage_widths[0]
        for cin, cout, stride, res in cfg.stages():
            out_res = res // stride
            fwd += 2.0 * out_res * out_res * 9 * (cin * cout + cout * cout)
            if (stride, cin) != (1, cout):
                fwd += 2.0 * out_res * out_res * cin * cout
        fwd += 2.0 * cfg.stage_widths[-1] * cfg.num_classes
        return 3.0 * fwd


WORKLOAD = CNNWorkload()
