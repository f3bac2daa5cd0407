"""The migrated training step: one jitted region per optimizer step.

Forward, backward, gradient accumulation over micro-batches (a `lax.scan` inside the same jit, so
one compile and one dispatch per global step), loss scaling for fp16, and the optimizer update.
State is donated. Data parallelism is `jax.make_mesh` + `NamedSharding`: each micro-batch sharded
along the mesh's "data" axis; XLA inserts the collectives (this replaces `pmap` + `lax.pmean`).

Two ways to hold the state (`SHARDINGS`): "replicated" keeps parameters, gradients and optimizer
state whole on every device (XLA all-reduces the gradients); "fsdp" shards each of them over the
same data axis (ZeRO-3 / FSDP: a `PartitionSpec` per array, see `fsdp_spec`), and each block
gathers its own parameters, in the compute dtype, just before it runs (inside the block's remat,
so the backward pass gathers them again instead of keeping them); XLA turns the gradient of that
gather into a reduce-scatter.

The same `TrainProgram` serves a measured run (concrete arrays) and compile-only planning
(`abstract_state` / `abstract_batch` as `jax.ShapeDtypeStruct`s on any mesh, a deviceless one too).

The TPU-era step (`pmap_step`, RunConfig.step_style "pmap") exists only as the measured "before" of
a migration, so that a run can time the step a TPU job starts from beside the one it moves to; `pmap`
is in maintenance mode and nothing new should be written with it. It is the guide's pattern:
`jax.pmap(step, axis_name=...)` over the devices, every state array replicated with a leading device
axis, each device's gradients and loss averaged with `lax.pmean`. Model, loss, accumulation, loss
scaling and optimizer are the same code as the jit step's (`step_fn(axis_name=...)`), and its batch
is the jit step's global batch laid out per device (`per_device_layout`), so on the same seed the two
styles train identically (BatchNorm aside: under pmap it normalises over each device's examples).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from migration.config.layouts import EXPERT_AXIS, TENSOR_AXIS, parse_layout
from migration.config.requests import RunConfig
from migration.step.fp8 import apply_fp8
from migration.step.policies import (
    PRECISION_POLICIES,
    remat_policy,
    DynamicLossScale,
    LossScaleState,
    PrecisionPolicy,
    RematPolicy,
    all_finite,
)
from workloads import get_workload
from workloads.base import Batch, Workload

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"


class TrainState(NamedTuple):
    params: Any  # nnx.State of nnx.Param, float32
    model_state: Any  # nnx.State of everything else (e.g. BatchNorm statistics); may be empty
    opt_state: Any
    loss_scale: LossScaleState | None  # None unless the precision policy scales the loss
    step: jax.Array  # int32 scalar


@dataclasses.dataclass(frozen=True)
class TrainProgram:
    """Everything the step needs, resolved once from a RunConfig."""

    workload: Workload
    model_cfg: Any
    precision: PrecisionPolicy
    remat: RematPolicy
    per_device_batch: int
    devices: int
    accumulation_steps: int
    learning_rate: float
    seed: int
    loss_scale: DynamicLossScale = DynamicLossScale()
    sharding: str = "replicated"  # a SHARDINGS key
    mu_dtype: str = "float32"  # AdamW's first moment (RunConfig.mu_dtype)

    @classmethod
    def from_config(cls, cfg: RunConfig, *, loss_scale: DynamicLossScale | None = None) -> "TrainProgram":
        workload = get_workload(cfg.workload)
        return cls(
            workload=workload,
            model_cfg=workload.config(cfg.preset, cfg.model),
            sharding=cfg.sharding,
            mu_dtype=cfg.mu_dtype,
            precision=PRECISION_POLICIES[cfg.precision],
            remat=remat_policy(cfg.remat),
            per_device_batch=cfg.per_device_batch,
            devices=cfg.devices,
            accumulation_steps=cfg.accumulation_steps,
            learning_rate=cfg.learning_rate,
            seed=cfg.seed,
            loss_scale=loss_scale or DynamicLossScale(),
        )

    # -- sizes -------------------------------------------------------------------------------
    @property
    def micro_batch(self) -> int:
        """Examples per micro-batch across all devices."""
        return self.per_device_batch * self.devices

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation_steps

    # -- model and optimizer -----------------------------------------------------------------
    def build_model(self, seed: int, mesh: Mesh | None = None) -> nnx.Module:
        model = self.workload.build(
            self.model_cfg,
            dtype=self.precision.compute_dtype,
            block_wrap=self.block_wrap(mesh),
            rngs=nnx.Rngs(seed),
        )
        if self.precision.fp8:
            apply_fp8(model, self.precision.fp8)
        return model

    def block_wrap(self, mesh: Mesh | None):
        """The remat policy's wrap, with the FSDP gather inside it when the state is sharded.

        Under FSDP the block's input is also held split by examples (its first axis): the weights
        outside the blocks (an embedding, a head) are sharded along whichever axis the device count
        divides, and without the constraint XLA may carry that split into the activations and run
        every example on every GPU (a GPT with a 50,304-word vocabulary on 256 GPUs did). Under
        tensor parallelism the gathered weights keep their tensor split; under expert parallelism the
        routed experts keep their expert split, and the block runs with the mesh as its ambient one (the
        workload's dispatch places its tokens on the expert axis: workloads/moe.py `expert_split`)."""
        remat = self.remat.block_wrap()
        if mesh is not None and (EXPERT_AXIS in mesh.axis_names or mesh.shape.get(TENSOR_AXIS, 1) > 1):
            remat = _in_mesh(remat, mesh)
        if not parse_layout(self.sharding).shards_state() or mesh is None or not self.workload.gathers_in_blocks:
            return remat
        dtype = self.precision.compute_dtype
        by_example = NamedSharding(mesh, P(batch_axes(mesh)))
        tensor = tensor_split(self.workload, mesh)

        def gathered(fn):
            def call(block, x, *args):
                graphdef, params, rest = nnx.split(block, nnx.Param, ...)
                params = jax.tree_util.tree_map_with_path(
                    lambda path, p: jax.lax.with_sharding_constraint(
                        p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p,
                        NamedSharding(mesh, tensor(path, p.shape))), params)
                x = jax.lax.with_sharding_constraint(x, by_example)
                return fn(nnx.merge(graphdef, params, rest), x, *args)
            return call

        return lambda fn: remat(gathered(fn))

    @property
    def optimizer(self) -> optax.GradientTransformation:
        """Global-norm clipping, then AdamW; its first moment in `mu_dtype` (None: the parameters' float32)."""
        mu = None if self.mu_dtype == "float32" else jnp.dtype(self.mu_dtype)
        return optax.chain(optax.clip_by_global_norm(1.0),
                           optax.adamw(self.learning_rate, weight_decay=1e-4, mu_dtype=mu))

    def graphdef(self, mesh: Mesh | None = None) -> Any:
        graphdef, _, _ = nnx.split(nnx.eval_shape(lambda: self.build_model(0, mesh)), nnx.Param, ...)
        return graphdef

    def init_state(self) -> TrainState:
        """Fresh parameters and optimizer state (call under jit, see `init_state_fn`)."""
        _, params, model_state = nnx.split(self.build_model(self.seed), nnx.Param, ...)
        loss_scale = self.loss_scale.init() if self.precision.loss_scaling else None
        return TrainState(params, model_state, self.optimizer.init(params), loss_scale, jnp.zeros((), jnp.int32))

    # -- data --------------------------------------------------------------------------------
    def make_batch(self, index: int | jax.Array) -> Batch:
        """Global batch number `index`, laid out (accumulation_steps, micro_batch, ...)."""
        key = jax.random.fold_in(jax.random.key(self.seed + 1), index)
        flat = self.workload.make_batch(self.model_cfg, key, self.global_batch)
        return jax.tree.map(lambda x: x.reshape(self.accumulation_steps, self.micro_batch, *x.shape[1:]), flat)

    def real_batches(self) -> Iterator[Batch] | None:
        """The workload's own data (`Workload.data_iterator`), global batch after global batch, laid out as
        `make_batch`'s; None where the workload trains on synthetic batches."""
        source = self.workload.data_iterator(self.model_cfg, self.global_batch)
        if source is None:
            return None
        lay = lambda x: x.reshape(self.accumulation_steps, self.micro_batch, *x.shape[1:])  # noqa: E731
        return (jax.tree.map(lay, batch) for batch in source)

    def batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        shapes = self.workload.batch_shapes(self.model_cfg, self.micro_batch)
        return {k: jax.ShapeDtypeStruct((self.accumulation_steps, *v.shape), v.dtype) for k, v in shapes.items()}

    # -- the step ----------------------------------------------------------------------------
    def grad_fn(self, mesh: Mesh | None = None):
        """`(params, model_state, micro_batch, scale) -> (grads of scale*loss, loss, model_state, metrics)`:
        metrics the workload reports beside its loss (`Workload.loss_and_metrics`; none for most)."""
        graphdef, workload = self.graphdef(mesh), self.workload

        # A kernel XLA cannot partition (TPU's splash attention, an MoE layer's grouped products) runs in
        # shard_map over the step's mesh, which the model reads from the context (only then set: every other
        # program stays as it was).
        in_mesh = mesh is not None and (getattr(self.model_cfg, "attention", "") == "splash"
                                        or getattr(self.model_cfg, "dispatch", "") == "dropless")

        def micro_step(params, model_state, micro: Batch, scale):
            def scaled_loss(p):
                # copy=True: fresh Variables at this trace level, so BatchNorm may update its stats
                model = nnx.merge(graphdef, p, model_state, copy=True)
                if not in_mesh:
                    loss, metrics = workload.loss_and_metrics(model, micro)
                else:
                    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                        loss, metrics = workload.loss_and_metrics(model, micro)
                _, _, new_model_state = nnx.split(model, nnx.Param, ...)
                return loss * scale, (loss, new_model_state, metrics)

            grads, (loss, new_model_state, metrics) = jax.grad(scaled_loss, has_aux=True)(params)
            return grads, loss, new_model_state, metrics

        return micro_step

    def step_fn(self, mesh: Mesh | None = None, axis_name: str | None = None):
        """The pure step `(state, batch) -> (state, metrics)` (`mesh`: where an FSDP state lives).

        `axis_name`: the pmap step's device axis (`pmap_step`). The accumulated gradients, the loss
        and floating model state (BatchNorm statistics) are then averaged over it with `lax.pmean`
        before the update; the jit step leaves the reduction to XLA and passes None."""
        tx, accum = self.optimizer, self.accumulation_steps
        scaler = self.loss_scale if self.precision.loss_scaling else None
        micro_step = self.grad_fn(mesh)

        def step(state: TrainState, batch: Batch):
            # Without loss scaling the scale is the Python float 1.0: no extra ops are traced.
            scale = state.loss_scale.scale if scaler else 1.0
            if accum == 1:
                micro = jax.tree.map(lambda x: x[0], batch)
                grads, loss, model_state, extra = micro_step(state.params, state.model_state, micro, scale)
            else:
                def body(carry, micro):
                    grad_sum, loss_sum, ms = carry
                    g, l, ms, extra = micro_step(state.params, ms, micro, scale)
                    return (jax.tree.map(jnp.add, grad_sum, g), loss_sum + l, ms), extra

                zeros = jax.tree.map(jnp.zeros_like, state.params)
                init = (zeros, jnp.zeros((), jnp.float32), state.model_state)
                (grad_sum, loss_sum, model_state), extras = jax.lax.scan(body, init, batch)
                grads = jax.tree.map(lambda g: g / accum, grad_sum)
                loss = loss_sum / accum
                extra = jax.tree.map(lambda v: jnp.mean(v, axis=0), extras)
            if axis_name is not None:
                grads, loss, model_state, extra = pmean_over_devices((grads, loss, model_state, extra), axis_name)
            if scaler:
                grads = jax.tree.map(lambda g: g / scale, grads)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "loss_scale": jnp.asarray(scale, jnp.float32),
                       **extra}
            loss_scale = None
            if scaler:
                finite = all_finite(grads)
                keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
                params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
                model_state = keep(model_state, state.model_state)
                loss_scale = scaler.update(state.loss_scale, finite)
                metrics["skipped"] = ~finite
            new_state = TrainState(params, model_state, opt_state, loss_scale, state.step + 1)
            return new_state, metrics

        return step


def _in_mesh(wrap, mesh: Mesh):
    """`wrap` with each wrapped call traced under `mesh` as the ambient (abstract) mesh."""
    def wrapped(fn):
        def call(*args, **kwargs):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return fn(*args, **kwargs)
        return wrap(call)
    return wrapped


# -- sharding and jit ---------------------------------------------------------------------------


def make_data_mesh(devices: list[Any]) -> Mesh:
    # Auto axes: XLA's partitioner places the gradient all-reduce (explicit axes would demand an
    # out_sharding on every gather, e.g. the embedding lookup).
    return jax.make_mesh((len(devices),), (DATA_AXIS,), axis_types=(AxisType.Auto,), devices=devices)


def make_mesh(devices: list[Any], layout: str = "replicated") -> Mesh:
    """The mesh of a layout (migration/config/layouts.py) over `devices`, numbered node by node:
    replicated and plain FSDP on one "data" axis (`make_data_mesh`); hybrid sharding, expert and tensor
    parallelism on ("data", "fsdp", ["expert",] "tensor"), the innermost axes inside a node."""
    lay = parse_layout(layout)
    if lay.kind != "hybrid" and lay.inner == 1:
        return make_data_mesh(devices)
    sizes = lay.axes(len(devices))
    auto = (AxisType.Auto,) * len(sizes)
    try:
        return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=auto, devices=devices)
    except NotImplementedError:  # an axis that is no product of whole physical axes (16 over a TPU's 8 x 8 x 8)
        grid = mesh_utils.create_device_mesh(tuple(sizes.values()), devices, allow_split_physical_axes=True)
        return Mesh(grid, tuple(sizes), axis_types=auto)


def make_multislice_mesh(devices: list[Any], layout: str, slices: int) -> Mesh:
    """`make_mesh` over TPU slices joined by the data-centre network (multislice), ordered slice by slice
    (each slice's devices in its own ICI order): a hybrid layout's FSDP groups are the slices, with data
    parallelism across them (MaxText's dcn_data_parallelism); plain FSDP shards over every slice's devices
    (dcn_fsdp_parallelism); expert and tensor splits stay inside a slice."""
    if slices == 1:
        return make_mesh(devices, layout)
    per_slice = len(devices) // slices
    lay = parse_layout(layout)
    if lay.kind == "hybrid" or lay.inner > 1:
        names = tuple(lay.axes(len(devices)))
        inner = {a: n for a, n in lay.axes(len(devices)).items() if a in (EXPERT_AXIS, TENSOR_AXIS)}
        outer = per_slice // lay.inner
        inside = {DATA_AXIS: outer if lay.kind == "replicated" else 1,
                  FSDP_AXIS: 1 if lay.kind == "replicated" else outer, **inner}
        across = {a: 1 for a in names} | ({FSDP_AXIS: slices} if lay.kind == "fsdp" else {DATA_AXIS: slices})
        grid = mesh_utils.create_hybrid_device_mesh(tuple(inside[a] for a in names), tuple(across[a] for a in names),
                                                    devices, allow_split_physical_axes=True)
        return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))
    grid = mesh_utils.create_hybrid_device_mesh((per_slice,), (slices,), devices)
    return Mesh(grid, (DATA_AXIS,), axis_types=(AxisType.Auto,))


def batch_axes(mesh: Mesh) -> str | tuple[str, ...]:
    """The mesh axes a batch is split over: every axis but the tensor split."""
    names = tuple(a for a in mesh.axis_names if a != TENSOR_AXIS)
    return names[0] if len(names) == 1 else names


def fsdp_axis(mesh: Mesh) -> str:
    return FSDP_AXIS if FSDP_AXIS in mesh.axis_names else DATA_AXIS


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """(accumulation_steps, micro_batch, ...): micro-batch split over the data axes."""
    return NamedSharding(mesh, P(None, batch_axes(mesh)))


def fsdp_spec(shape: tuple[int, ...], devices: int, axis: str = DATA_AXIS, taken: P | None = None) -> P:
    """Shard an array's largest dimension that the device count divides (the last such on a tie),
    over `axis`; replicate it when none does (scalars, small vectors). A stacked layer axis
    is never the largest in practice, so the scanned layer loop slices an unsharded axis. `taken`:
    a spec already splitting some dimensions (tensor parallelism): those are left as they are."""
    used = tuple(taken) + (None,) * (len(shape) - len(tuple(taken))) if taken is not None else (None,) * len(shape)
    best = None
    for dim, size in enumerate(shape):
        if used[dim] is None and size % devices == 0 and size >= devices and (best is None or size >= shape[best]):
            best = dim
    if best is None or devices == 1:
        return P(*used) if any(u is not None for u in used) else P()
    return P(*[axis if dim == best else used[dim] for dim in range(len(shape))])


def tensor_split(workload: Workload, mesh: Mesh) -> Callable[..., P]:
    """`(path, shape) -> PartitionSpec` of a parameter's (or its optimizer moment's) model-parallel
    split: the workload's `tensor_parallel_spec` over the mesh's tensor axis, and its
    `expert_parallel_spec` over the expert axis, by the names on the path; P() on a mesh without
    either axis."""
    shards, experts = mesh.shape.get(TENSOR_AXIS, 1), mesh.shape.get(EXPERT_AXIS, 1)

    def spec(path: Any, shape: tuple[int, ...]) -> P:
        if shards == 1 and experts == 1:
            return P()
        names = tuple(n for n in (str(getattr(k, "key", getattr(k, "name", k))) for k in path) if n != "value")
        shape = tuple(shape)
        split = [None] * len(shape)
        if shards > 1:
            tensor = tuple(workload.tensor_parallel_spec(names, shape, shards, TENSOR_AXIS))
            split[:len(tensor)] = tensor
        if experts > 1:
            for dim, axis in enumerate(workload.expert_parallel_spec(names, shape, experts, EXPERT_AXIS)):
                if axis is not None and split[dim] is None:
                    split[dim] = axis
        return P(*split) if any(a is not None for a in split) else P()

    return spec


def state_shardings(program: TrainProgram, mesh: Mesh) -> TrainState:
    """A NamedSharding per state array: replicated, FSDP over the FSDP axis (`fsdp_spec`), and the
    tensor and expert splits of each weight where the layout has them. With an expert axis, a weight
    that is no routed expert's is sharded over it too (FSDP over fsdp x expert, as MaxText's
    ``ici_expert_parallelism`` does); a routed expert's, already split by it, over the FSDP axis alone."""
    shapes = jax.eval_shape(program.init_state)
    lay = parse_layout(program.sharding)
    split = tensor_split(program.workload, mesh)
    n = mesh.shape[fsdp_axis(mesh)] if lay.shards_state() else 1
    experts = mesh.shape.get(EXPERT_AXIS, 1)

    def place(path: Any, s: Any) -> NamedSharding:
        taken = split(path, s.shape)
        if experts > 1 and lay.shards_state() and EXPERT_AXIS not in tuple(taken):
            axes = tuple(a for a in (fsdp_axis(mesh), EXPERT_AXIS) if mesh.shape[a] > 1)
            return NamedSharding(mesh, fsdp_spec(s.shape, n * experts, axes if len(axes) > 1 else axes[0], taken))
        return NamedSharding(mesh, fsdp_spec(s.shape, n, fsdp_axis(mesh), taken) if n > 1 else taken)

    return jax.tree_util.tree_map_with_path(place, shapes)


def abstract_state(program: TrainProgram, mesh: Mesh) -> TrainState:
    shapes = jax.eval_shape(program.init_state)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                        state_shardings(program, mesh))


def abstract_batch(program: TrainProgram, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    bs = batch_sharding(mesh)
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=bs) for k, v in program.batch_shapes().items()}


def jit_step(program: TrainProgram, mesh: Mesh):
    """The jitted step with explicit shardings (so outputs never drift) and donated state."""
    state_sharding = state_shardings(program, mesh)
    batch_sh = {k: batch_sharding(mesh) for k in program.batch_shapes()}
    return jax.jit(
        program.step_fn(mesh),
        in_shardings=(state_sharding, batch_sh),
        out_shardings=(state_sharding, replicated(mesh)),
        donate_argnums=0,
    )


def init_state_on(program: TrainProgram, mesh: Mesh) -> TrainState:
    return jax.jit(program.init_state, out_shardings=state_shardings(program, mesh))()


def batch_maker(program: TrainProgram, mesh: Mesh):
    """A jitted `index -> batch` placed with the step's batch sharding (compiled once). On a mesh
    that spans several processes (migration/config/distributed.py) each process computes only its own
    shards of the same global batch: no per-process input pipeline, and the losses of a one-process run."""
    sharding = {k: batch_sharding(mesh) for k in program.batch_shapes()}
    real = program.real_batches()
    if real is not None:
        if jax.process_count() > 1:
            raise ValueError("the workload's own data feeds a run of one process; a multi-process run trains on "
                             "its synthetic batches (make_batch)")
        return lambda index: jax.device_put(next(real), sharding)
    make = jax.jit(program.make_batch, out_shardings=sharding)
    return lambda index: make(jnp.asarray(index, jnp.int32))


# -- the TPU-era step: pmap (the measured "before" only) -----------------------------------------

def pmean_over_devices(tree: Any, axis_name: str) -> Any:
    """Each floating leaf averaged over the pmap axis (`lax.pmean`); integer leaves kept as they are."""
    return jax.tree.map(lambda x: jax.lax.pmean(x, axis_name)  # migration: ignore[PMAP002] the measured "before" step
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def pmap_mesh(devices: Sequence[Any]) -> Mesh:
    """The mesh `jax.pmap(..., devices=devices, axis_name=DATA_AXIS)` maps over (pmap is jit over
    shard_map in this JAX). Arrays placed on it with `P(DATA_AXIS)` enter the pmapped step without a
    copy, and the step's outputs come back with the same sharding, so no call recompiles."""
    return Mesh(np.asarray(list(devices)), (DATA_AXIS,))


def per_device(mesh: Mesh) -> NamedSharding:
    """Leading axis split over the devices: one slice per device, as pmap takes its arguments."""
    return NamedSharding(mesh, P(DATA_AXIS))


def pmap_step(program: TrainProgram, devices: Sequence[Any]):
    """The TPU-era step as the guide writes it: `jax.pmap` of the step over `devices`, gradients
    and loss `lax.pmean`'d over the device axis (`step_fn(axis_name=...)`), state donated. Takes the
    replicated state (`init_state_replicated`) and the per-device batch (`pmap_batch_maker`); every
    metric comes back once per device (`unreplicate`)."""
    if program.sharding != "replicated":
        raise ValueError(f"the pmap step replicates the state on every device; got sharding {program.sharding!r}")
    if len(devices) != program.devices:
        raise ValueError(f"the program is for {program.devices} devices; got {len(devices)}")
    step, where = program.step_fn(axis_name=DATA_AXIS), tuple(devices)
    return jax.pmap(step, axis_name=DATA_AXIS, devices=where, donate_argnums=0)  # migration: ignore[PMAP001] the "before" step


def init_state_replicated(program: TrainProgram, mesh: Mesh) -> TrainState:
    """Fresh state (the jit step's `init_state`, same seed) with a leading device axis, one copy per
    device: the state pmap takes (what `device_put_replicated` used to build)."""
    n = mesh.devices.size

    def init() -> TrainState:
        return _device_copies(program.init_state(), n)

    return jax.jit(init, out_shardings=per_device(mesh))()


def replicate_per_device(state: TrainState, mesh: Mesh) -> TrainState:
    """A jit step's replicated state (e.g. a restored checkpoint) as pmap takes it: one copy per device."""
    return jax.jit(lambda s: _device_copies(s, mesh.devices.size), out_shardings=per_device(mesh))(state)


def _device_copies(tree: Any, n: int) -> Any:
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), tree)


def per_device_layout(program: TrainProgram, batch: Batch) -> Batch:
    """The jit step's batch (accumulation_steps, micro_batch, ...) as pmap takes it, (devices,
    accumulation_steps, per_device_batch, ...): device d gets, at every micro-step, the same examples
    as the jit step's shard d of that micro-batch."""
    def split(x: jax.Array) -> jax.Array:
        x = x.reshape(program.accumulation_steps, program.devices, program.per_device_batch, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    return jax.tree.map(split, batch)


def pmap_batch_maker(program: TrainProgram, mesh: Mesh):
    """A jitted `index -> batch` for the pmap step: global batch `index` of `make_batch` (the jit
    step's data), laid out per device and placed one slice per device (compiled once)."""
    real = program.real_batches()
    if real is not None:  # the same batches as the jit step's, in the same order
        return lambda index: jax.device_put(per_device_layout(program, next(real)), per_device(mesh))
    make = jax.jit(lambda index: per_device_layout(program, program.make_batch(index)),
                   out_shardings=per_device(mesh))
    return lambda index: make(jnp.asarray(index, jnp.int32))


def unreplicate(tree: Any) -> Any:
    """Device 0's copy of every leaf of a pmap output (the metrics: pmean'd, equal on all devices)."""
    return jax.tree.map(lambda x: x[0], tree)


# -- either style, for a measured run ------------------------------------------------------------

class StepParts(NamedTuple):
    """What a run needs of one step style on its devices."""

    step: Callable[..., Any]  # (state, batch) -> (state, metrics); the state is donated
    init_state: Callable[[], TrainState]
    make_batch: Callable[[int], Batch]  # global batch number -> batch, placed as `step` takes it
    host_metrics: Callable[[Any], Any]  # fetched metrics -> one value per metric
    mesh: Mesh  # the devices the state and batches live on


def step_parts(program: TrainProgram, devices: Sequence[Any], style: str = "jit") -> StepParts:
    """The migrated jit step ("jit") or the TPU-era pmap step ("pmap", see `pmap_step`) on `devices`."""
    if style == "pmap":
        mesh = pmap_mesh(devices)
        return StepParts(pmap_step(program, devices), lambda: init_state_replicated(program, mesh),
                         pmap_batch_maker(program, mesh), unreplicate, mesh)
    if style != "jit":
        raise ValueError(f"step style must be jit or pmap; got {style!r}")
    mesh = make_mesh(list(devices), program.sharding)
    return StepParts(jit_step(program, mesh), lambda: init_state_on(program, mesh), batch_maker(program, mesh),
                     lambda metrics: metrics, mesh)
