"""The protocol every workload follows, and the pieces they share.

What a workload must say is what only its author knows: how to make the model (a Flax NNX builder;
the other styles, Linen, Haiku, Equinox and plain functions, are adapters in `workloads/` that make
one), the loss of a batch, and the batch's shapes and dtypes. Everything else has a default read
from the program JAX traces of that loss (`workloads/derive.py`): the parameter count from the
parameter tree, the FLOPs per example from its matrix products, the activations it keeps for the
backward pass, the activations it names, the tokens per example from the batch. A workload may
override any of them with an analytic count (the built-in families do: tests compare the two), and
may give a synthetic batch whose labels follow a rule the model can learn (the default draws random
values of the batch's shapes). The training step in `migration/` knows nothing else about a model.

Precision and rematerialisation reach a model only as two arguments of `build`: the compute dtype
(parameters stay in float32) and `block_wrap`, a function applied to each block's call (identity
or a `nnx.remat` with a policy). Model code never asks which platform it runs on.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

Batch = dict[str, jax.Array]
BlockWrap = Callable[[Callable[..., Any]], Callable[..., Any]]


def no_wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The `block_wrap` for "no rematerialisation"."""
    return fn


@dataclasses.dataclass(frozen=True)
class Remat:
    """The `block_wrap` of a remat policy: `nnx.remat` of a block's call with the `jax.checkpoint`
    policy `policy` (None: save nothing). Adapters of other styles read `policy` and wrap in their
    own way (`hk.remat`, `nn.remat`, `jax.checkpoint`)."""

    policy: Callable[..., bool] | None = None

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return nnx.remat(fn, policy=self.policy)


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
    # Whether each `block_wrap`ped call takes an NNX block first (FSDP then gathers that block's
    # weights inside the wrap); adapters of other styles wrap plain functions and say False.
    gathers_in_blocks: ClassVar[bool] = True
    # Whether the model's products are `nnx.Linear` layers, which the fp8 recipes replace.
    fp8_linears: ClassVar[bool] = True

    def tensor_parallel_spec(self, path: tuple[str, ...], shape: tuple[int, ...], shards: int,
                             axis: str) -> jax.sharding.PartitionSpec:
        """How the weight at `path` (names, e.g. ("blocks", "attn", "q", "kernel")) of `shape` splits over
        `shards` GPUs on mesh axis `axis` under tensor parallelism; whole (P()) unless a workload says."""
        return jax.sharding.PartitionSpec()

    def routed_experts(self, cfg: Any) -> int:
        """Routed experts of each MoE layer (0: no experts, so no layout with +epE applies)."""
        return 0

    def routed_expert_params(self, cfg: Any) -> int:
        """Parameters of the routed experts (those expert parallelism splits); 0 without experts."""
        return 0

    def dispatch_bytes_per_example(self, cfg: Any, elem: int) -> float:
        """Bytes an example's tokens send to their experts and back in one forward pass (each at `elem`
        bytes a value) under expert parallelism; 0 without experts."""
        return 0.0

    def expert_parallel_spec(self, path: tuple[str, ...], shape: tuple[int, ...], shards: int,
                             axis: str) -> jax.sharding.PartitionSpec:
        """How the weight at `path` splits its experts over `shards` GPUs on mesh axis `axis` under expert
        parallelism; whole (P()) for a weight that is no routed expert's."""
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

    def make_batch(self, cfg: Any, key: jax.Array, batch_size: int) -> Batch:
        """A synthetic batch of `batch_shapes`: floats drawn from a unit Gaussian, integers uniform
        in [0, `value_high`). Jittable. A workload whose labels should follow a learnable rule
        overrides it."""
        shapes = self.batch_shapes(cfg, batch_size)
        keys = jax.random.split(key, max(1, len(shapes)))
        out = {}
        for k, (name, s) in zip(keys, sorted(shapes.items())):
            if jnp.issubdtype(s.dtype, jnp.floating):
                out[name] = jax.random.normal(k, s.shape, jnp.float32).astype(s.dtype)
            elif s.dtype == jnp.bool_:
                out[name] = jax.random.bernoulli(k, 0.5, s.shape)
            else:
                out[name] = jax.random.randint(k, s.shape, 0, self.value_high(cfg, name), s.dtype)
        return out

    def data_iterator(self, cfg: Any, batch_size: int) -> Iterator[Batch] | None:
        """The workload's own data, one global batch of `batch_size` examples at a time (host arrays of
        `batch_shapes`), or None: the synthetic batches of `make_batch` (the default)."""
        return None

    def value_high(self, cfg: Any, name: str) -> int:
        """Integer entries of the default synthetic batch lie in [0, value_high) (e.g. a vocabulary)."""
        return 2

    @abc.abstractmethod
    def loss(self, model: nnx.Module, batch: Batch) -> jax.Array:
        """Scalar float32 training loss (mean over the batch)."""

    def loss_and_metrics(self, model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The loss and float32 scalars the step reports beside it (a mixture-of-experts router's dropped
        share and load); none unless a workload says."""
        return self.loss(model, batch), {}

    # -- what the program says (defaults; a workload may override each with an analytic count) ----
    def facts(self, cfg: Any) -> "ModelFacts":
        """Parameters, FLOPs, activations and names read from the traced loss (cached per config)."""
        return _facts(self, cfg)

    def param_count(self, cfg: Any) -> int:
        """Trainable parameters: by default the elements of the parameter tree."""
        return self.facts(cfg).params

    def flops_per_example(self, cfg: Any) -> float:
        """Model FLOPs of one training example: forward plus backward (about 3x forward). By default the
        traced program's matrix products and their gradients (`workloads/derive.py`).

        Recomputation by rematerialisation is not counted, so MFU stays comparable across policies.
        """
        return self.facts(cfg).train_flops

    def activation_profile(self, cfg: Any) -> "ActivationProfile":
        """Rough activation sizes per example, for the planner's analytic fallback estimate. By
        default what the backward pass of the traced loss keeps, as one block."""
        f = self.facts(cfg)
        return ActivationProfile(per_block=float(f.residuals), block_input=float(f.inputs), n_blocks=1)

    def remat_unavailable(self, remat: str, saved_names: tuple[str, ...] = ()) -> str | None:
        """Why the remat policy `remat` (saving the activations `saved_names`) does not apply to this
        workload, or None where it does: a named policy needs the model to tag those activations."""
        missing = [n for n in saved_names if n not in self.checkpoint_names]
        if missing:
            return (f"{self.name} tags no activation {', '.join(missing)} with checkpoint_name "
                    f"(it tags {', '.join(self.checkpoint_names) or 'none'})")
        return None

    def forward_flops_by_part(self, cfg: Any) -> dict[str, float]:
        """Forward FLOPs per example of the blocks, by part, for the cost of recomputing them
        (`migration.planning.search.RECOMPUTES`). By default all of the forward pass is one part."""
        return {"block": self.flops_per_example(cfg) / 3}

    def tokens_per_example(self, cfg: Any) -> int | None:
        """Tokens in one example, for tokens/s; None where the notion does not apply. By default the
        length of the batch's first integer entry of one example that is a sequence (rank 2 with the
        batch axis), e.g. token ids; None where there is none."""
        for _, s in sorted(self.batch_shapes(cfg, 1).items()):
            if len(s.shape) == 2 and jnp.issubdtype(s.dtype, jnp.integer):
                return int(s.shape[1])
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

    def code_files(self) -> list[str]:
        """The source files of the model's code (an edit to them compiles anew): its class's module."""
        try:
            source = inspect.getsourcefile(type(self))
        except TypeError:
            source = None
        return [source] if source else []


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


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the traced loss of one config says (`workloads/derive.py`): parameters (elements and
    float32 bytes), forward and training FLOPs per example, elements the backward pass keeps per example
    (`residuals`) and the batch's elements per example (`inputs`), the activations it tags with
    `checkpoint_name`, the typical output width of its products, and while loops of unknown length."""

    params: int
    param_bytes: int
    forward_flops: float
    train_flops: float
    residuals: int
    inputs: int
    names: tuple[str, ...]
    width: int
    unknown_loops: int


def check_batch_spec(spec: Any, where: str) -> dict[str, jax.ShapeDtypeStruct]:
    """`spec` as a dict of `jax.ShapeDtypeStruct`, or ModelConfigError naming what is wrong."""
    if not isinstance(spec, Mapping) or not spec:
        raise ModelConfigError("batch", f"{where} gave {type(spec).__name__}, not a dict of name -> "
                                        "jax.ShapeDtypeStruct(shape, dtype)")
    out = {}
    for name, s in spec.items():
        if not isinstance(s, jax.ShapeDtypeStruct):
            raise ModelConfigError("batch", f"entry {name!r} is a {type(s).__name__}, not a jax.ShapeDtypeStruct")
        if not (jnp.issubdtype(s.dtype, jnp.number) or s.dtype == jnp.bool_):
            raise ModelConfigError("batch", f"entry {name!r} has dtype {s.dtype}: allowed are float, integer and bool")
        out[str(name)] = s
    return out


def check_loss_value(out: Any, where: str) -> None:
    """ModelConfigError unless `out` (abstract) is a floating scalar."""
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape is None or dtype is None:
        raise ModelConfigError("loss", f"{where} returns a {type(out).__name__}, not a scalar array")
    if tuple(shape) != () or not jnp.issubdtype(dtype, jnp.floating):
        raise ModelConfigError("loss", f"{where} returns {dtype}{list(shape)}, not a floating scalar (reduce it "
                                       "over the batch, e.g. with .mean())")


@functools.lru_cache(maxsize=64)
def _facts(workload: Workload, cfg: Any) -> ModelFacts:
    from workloads import derive  # reason: only the derived defaults need the program reader

    model = nnx.eval_shape(lambda: workload.build(cfg, dtype=jnp.float32, block_wrap=no_wrap, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    where = f"{workload.name}'s loss"

    def loss_of(p: Any, r: Any, batch: Batch) -> jax.Array:
        return workload.loss(nnx.merge(graphdef, p, r, copy=True), batch)

    batches = [check_batch_spec(workload.batch_shapes(cfg, n), f"{workload.name}'s batch_shapes") for n in (1, 2)]
    check_loss_value(jax.eval_shape(loss_of, params, rest, batches[0]), where)
    program = derive.read_program(loss_of, params, rest, batches[0])
    kept = [derive.residual_elements(loss_of, params, rest, b) for b in batches]
    return ModelFacts(
        params=derive.count_elements(params), param_bytes=derive.count_bytes(params),
        forward_flops=program.flops, train_flops=program.train_flops, residuals=max(0, kept[1] - kept[0]),
        inputs=derive.count_elements(batches[1]) - derive.count_elements(batches[0]),
        names=tuple(sorted(program.names)), width=program.typical_width(), unknown_loops=program.unknown_loops)


def checked_batches(workload: Workload, cfg: Any, source: Callable[[int], Iterable[Batch]],
                    batch_size: int) -> Iterator[Batch]:
    """The batches of a user's data iterator (`source(batch_size)`), each checked against the workload's
    `batch_shapes` (ModelConfigError naming the entry that differs, or saying the data ran out)."""
    import numpy as np  # reason: only a real-data run reads host arrays

    expected = workload.batch_shapes(cfg, batch_size)
    count = 0
    for batch in source(batch_size):
        if not isinstance(batch, Mapping) or set(batch) != set(expected):
            got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise ModelConfigError("data", f"batch {count} has entries {got}; the batch spec has {sorted(expected)}")
        out = {}
        for name, spec in expected.items():
            value = np.asarray(batch[name])
            if value.shape != spec.shape or value.dtype != spec.dtype:
                raise ModelConfigError("data", f"batch {count} entry {name!r} is {value.dtype}{list(value.shape)}; "
                                               f"the batch spec says {spec.dtype}{list(spec.shape)}")
            out[name] = value
        count += 1
        yield out
    raise ModelConfigError("data", f"the data ran out after {count} batch(es) of {batch_size}")
