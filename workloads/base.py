"""The protocol every workload follows, and the pieces they share.

A workload owns four things: a frozen config per preset, a Flax NNX model builder, a synthetic
data generator with fixed shapes whose labels follow a rule the model can learn, and its cost
(parameter count and analytic training FLOPs per example). The training step in `migration/`
knows nothing else about a model.

Precision and rematerialisation reach a model only as two arguments of `build`: the compute dtype
(parameters stay in float32) and `block_wrap`, a function applied to each block's call (identity
or a `nnx.remat` with a policy). Model code never asks which platform it runs on.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

Batch = dict[str, jax.Array]
BlockWrap = Callable[[Callable[..., Any]], Callable[..., Any]]


def no_wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The `block_wrap` for "no rematerialisation"."""
    return fn


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy, always reduced in float32 whatever the compute dtype."""
    import optax  # reason: import-time cost: the config layer imports `workloads` without Optax

    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()


# Tokens per chunk of the chunked cross-entropy: the float32 logits alive at once are
# batch x LOSS_CHUNK x vocab instead of batch x sequence x vocab.
LOSS_CHUNK = 128
# Below this many logits per example (sequence x vocab) the loss is computed in one piece.
LOSS_CHUNK_MIN_LOGITS = 2**20


def chunked_cross_entropy(
    hidden: jax.Array, project: Callable[[jax.Array], jax.Array], labels: jax.Array, chunk: int = LOSS_CHUNK
) -> jax.Array:
    """Mean softmax cross-entropy of `project(hidden)` against `labels`, without the full logits.

    hidden: (B, T, D); project maps (B, c, D) to (B, c, V) logits; labels: (B, T) int. The sequence
    is cut into chunks of `chunk` tokens (the last one padded and masked), and a scan computes each
    chunk's logits, their float32 log-sum-exp and the picked logit. Each chunk's body is
    rematerialised, so the backward pass recomputes a chunk's logits from its slice of `hidden`
    instead of keeping all B x T x V of them (in float32, with their softmax, that is most of a
    large-vocabulary model's activation memory). Small problems are computed in one piece.
    """
    b, t, _ = hidden.shape
    probe = jax.eval_shape(project, jax.ShapeDtypeStruct((b, 1, hidden.shape[-1]), hidden.dtype))
    if t <= chunk or t * probe.shape[-1] < LOSS_CHUNK_MIN_LOGITS:
        return cross_entropy(project(hidden), labels)
    n = -(-t // chunk)
    pad = n * chunk - t
    mask = jnp.arange(n * chunk) < t
    xs = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, -1).swapaxes(0, 1)  # (n, B, c, D)
    ys = jnp.pad(labels, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)  # (n, B, c)
    ms = mask.reshape(n, 1, chunk)

    @jax.checkpoint
    def piece(x: jax.Array, y: jax.Array, m: jax.Array) -> jax.Array:
        logits = project(x).astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(m, lse - picked, 0.0))

    def step(total: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        return total + piece(*xs), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (xs, ys, ms))
    return total / (b * t)


class ModelConfigError(ValueError):
    """A model dimension is out of range or inconsistent. `str()` is one line naming it."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


class Workload(abc.ABC):
    """One trainable workload. Subclasses are final and stateless; configs carry the sizes.

    A config is a preset with optional overrides of its fields (`config`), checked by `check`.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    presets: ClassVar[Mapping[str, Any]]
    default_preset: ClassVar[str]
    # The preset that dimensions given without a preset start from (its layout: tied or not, etc.).
    custom_base: ClassVar[str] = "tiny"
    # Config fields a user may override (each checked by `check`); none unless a workload says so.
    convolutional: ClassVar[bool] = False  # its products are convolutions (not dots): remat policies differ
    free_dimensions: ClassVar[tuple[str, ...]] = ()
    # Activations the model tags with `jax.ad_checkpoint.checkpoint_name`: the named remat policies
    # (save or offload these, recompute the rest) apply only to a workload that names theirs.
    checkpoint_names: ClassVar[tuple[str, ...]] = ()
    # Whether `tensor_parallel_spec` splits any weight (a layout with +tpT applies only then).
    tensor_parallel: ClassVar[bool] = False

    def tensor_parallel_spec(self, path: tuple[str, ...], shape: tuple[int, ...], shards: int,
                             axis: str) -> jax.sharding.PartitionSpec:
        """How the weight at `path` (names, e.g. ("blocks", "attn", "q", "kernel")) of `shape` splits over
        `shards` GPUs on mesh axis `axis` under tensor parallelism; whole (P()) unless a workload says."""
        return jax.sharding.PartitionSpec()

    def config(self, preset: str, overrides: Mapping[str, Any] | None = None) -> Any:
        """The preset's config with `overrides` (field -> value) applied and checked."""
        base = self.presets[preset]
        if not overrides:
            return base
        unknown = sorted(set(overrides) - set(self.free_dimensions))
        if unknown:
            allowed = ", ".join(self.free_dimensions) or "none (its presets only)"
            raise ModelConfigError(unknown[0], f"not a dimension of {self.name} that can be changed; allowed: {allowed}")
        changes = {**self.follow(base, dict(overrides)), **overrides}
        return self.check(dataclasses.replace(base, **changes))

    def follow(self, preset: Any, overrides: dict[str, Any]) -> dict[str, Any]:
        """Fields that follow an override when not given themselves (none by default)."""
        return {}

    def check(self, cfg: Any) -> Any:
        """`cfg` unchanged if valid, else ModelConfigError. Workloads with free dimensions override."""
        return cfg

    @abc.abstractmethod
    def build(self, cfg: Any, *, dtype: Any, block_wrap: BlockWrap, rngs: nnx.Rngs) -> nnx.Module:
        """The model, parameters in float32, computing in `dtype`, each block wrapped."""

    @abc.abstractmethod
    def batch_shapes(self, cfg: Any, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of one batch (fixed: no shape ever depends on the data)."""

    @abc.abstractmethod
    def make_batch(self, cfg: Any, key: jax.Array, batch_size: int) -> Batch:
        """A synthetic batch drawn from a fixed, learnable distribution. Jittable."""

    @abc.abstractmethod
    def loss(self, model: nnx.Module, batch: Batch) -> jax.Array:
        """Scalar float32 training loss (mean over the batch)."""

    @abc.abstractmethod
    def param_count(self, cfg: Any) -> int:
        """Analytic number of trainable parameters."""

    @abc.abstractmethod
    def flops_per_example(self, cfg: Any) -> float:
        """Analytic model FLOPs of one training example: forward plus backward (3x forward).

        Recomputation by rematerialisation is not counted, so MFU stays comparable across policies.
        """

    @abc.abstractmethod
    def activation_profile(self, cfg: Any) -> "ActivationProfile":
        """Rough activation sizes per example, for the planner's analytic fallback estimate."""

    def forward_flops_by_part(self, cfg: Any) -> dict[str, float]:
        """Forward FLOPs per example of the blocks, by part, for the cost of recomputing them
        (`migration.planning.search.RECOMPUTES`). By default all of the forward pass is one part."""
        return {"block": self.flops_per_example(cfg) / 3}

    def tokens_per_example(self, cfg: Any) -> int | None:
        """Tokens in one example, for tokens/s; None where the notion does not apply."""
        return None

    def rows_per_example(self, cfg: Any) -> int:
        """Rows one example contributes to the model's largest matrix products (tokens for a
        sequence model, output pixels for a convolution as an implicit GEMM, 1 for an MLP). The
        planner's step-time model uses it to tell when a micro-batch is too small to fill a GPU."""
        return self.tokens_per_example(cfg) or 1

    def matmul_width(self, cfg: Any) -> int:
        """Typical output width of the model's large matrix products (columns of a GEMM): with
        `rows_per_example`, how many output tiles a micro-batch gives the GPU to fill its SMs."""
        return 128

    def describe(self, cfg: Any) -> dict[str, Any]:
        return {"workload": self.name, **dataclasses.asdict(cfg)}


@dataclasses.dataclass(frozen=True)
class ActivationProfile:
    """Elements kept for the backward pass, per example, at the compute dtype unless noted.

    per_block: everything one block keeps without remat; block_input: what a fully
    rematerialised block keeps (its input); head_fp32: float32 elements outside the blocks
    (e.g. logits, their softmax and gradient); n_blocks: how many blocks.
    """

    per_block: float
    block_input: float
    n_blocks: int
    head_fp32: float = 0.0
    # Per block, elements of each activation the model tags with `checkpoint_name` (its
    # `checkpoint_names`): what a named remat policy keeps.
    named: Mapping[str, float] = dataclasses.field(default_factory=dict)


def prototype_classification_batch(
    key: jax.Array, batch_size: int, shape: tuple[int, ...], num_classes: int, signal: float
) -> Batch:
    """Inputs = `signal` x a fixed prototype per class plus unit Gaussian noise; label = class.

    With d input values, two classes' means are about signal * sqrt(2d) apart against unit noise:
    the presets pick `signal` so that the task is learnable but not solved in a handful of steps.

    The prototypes come from a constant key, so every batch, seed and device count samples the same
    task; only the draw of labels and noise depends on `key`.
    """
    prototypes = jax.random.normal(jax.random.key(20261129), (num_classes, *shape), jnp.float32)
    k_label, k_noise = jax.random.split(key)
    labels = jax.random.randint(k_label, (batch_size,), 0, num_classes, dtype=jnp.int32)
    x = signal * prototypes[labels] + jax.random.normal(k_noise, (batch_size, *shape), jnp.float32)
    return {"x": x, "label": labels}
