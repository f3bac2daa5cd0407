"""What the adapters share: a model that is a parameter tree and a loss function, as an NNX module.

Linen, Haiku, Equinox and plain functions all come down to `init(key) -> (parameters, state)` and
`loss(parameters, state, batch, key) -> (scalar, new state)` over pytrees. `TreeWorkload` turns such a
pair into the one `Workload` protocol the planner and the runner know: `TreeModel` holds each parameter
leaf as an `nnx.Param` (float32 master weights) under its path ("Dense_0/kernel", "transformer/~/mlp/w"),
the rest of the state (batch statistics, Haiku state) as carried variables, and a random key for
dropout; its loss casts the floating parameters and batch entries to the compute dtype at the step
boundary and calls the user's function. Everything else, from the parameter count to the FLOPs, is read
from that program (`workloads/base.py` defaults).

Decisions on code the product did not write:

- precision: any tree (float32 masters, compute dtype cast at the boundary; fp16's loss scaling is the
  step's). The fp8 recipes replace `nnx.Linear` products, which these models do not have: not offered.
- sharding: replicated and FSDP on any tree (each array's largest divisible dimension); tensor
  parallelism where the user's partition rules say (`partition_rules`: a regular expression over the
  parameter's path to a tuple of logical axis names, one per dimension, as t5x, big_vision and
  levanter write them; the names in `TENSOR_AXES` split over the GPUs of the tensor axis).
- remat: where the user's code takes a `block_wrap` argument, each policy is applied where that code
  puts it (its blocks); where the user names blocks by class or path (`remat_blocks`, Haiku and
  Equinox), the adapter wraps those; otherwise the policies that save something (`dots`, named activations the
  program tags with `checkpoint_name`) wrap the whole loss in one `jax.checkpoint`, and `full` (save
  nothing) is not offered: around the whole loss it would recompute everything and save nothing.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from workloads.base import Batch, BlockWrap, ModelConfigError, Remat, Workload, checked_batches

# Logical axis names that tensor parallelism splits (the others, e.g. "embed", stay whole).
TENSOR_AXES = frozenset({"model", "tensor", "mlp", "heads", "kv_heads", "q_heads", "vocab", "joined_kv", "kv"})
DTYPES = ("float32", "bfloat16", "float16", "int32", "int64", "int16", "int8", "uint8", "uint32", "bool")


@dataclasses.dataclass(frozen=True)
class Spec:
    """One entry of a batch, per example: its shape, dtype, and for integers the range [0, high) of
    the synthetic values (a vocabulary, a number of classes)."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    high: int | None = None


@dataclasses.dataclass(frozen=True)
class Yours:
    """The config of a model that keeps its sizes in its own code: its name only."""

    model: str


def batch_spec(batch: Mapping[str, Any]) -> dict[str, Spec]:
    """A batch description as `Spec`s: each entry a Spec, `(shape, dtype)`, `(shape, dtype, high)` or a
    `jax.ShapeDtypeStruct` (shape per example). ModelConfigError naming the entry otherwise."""
    if not isinstance(batch, Mapping) or not batch:
        raise ModelConfigError("batch", "give a dict of name -> (shape per example, dtype[, high])")
    out = {}
    for name, entry in batch.items():
        if isinstance(entry, jax.ShapeDtypeStruct):
            entry = Spec(tuple(entry.shape), str(entry.dtype))
        elif isinstance(entry, (tuple, list)) and 2 <= len(entry) <= 3:
            entry = Spec(*entry)
        if not isinstance(entry, Spec):
            raise ModelConfigError("batch", f"entry {name!r} is {entry!r}: give (shape per example, dtype[, high])")
        shape = tuple(entry.shape) if isinstance(entry.shape, (tuple, list)) else None
        if shape is None or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise ModelConfigError("batch", f"entry {name!r} has shape {entry.shape!r}: a tuple of positive integers")
        dtype = str(jnp.dtype(entry.dtype)) if _known_dtype(entry.dtype) else None
        if dtype not in DTYPES:
            raise ModelConfigError("batch", f"entry {name!r} has dtype {entry.dtype!r}: allowed are {', '.join(DTYPES)}")
        integer = jnp.issubdtype(dtype, jnp.integer)
        if integer and not (isinstance(entry.high, int) and entry.high >= 1):
            raise ModelConfigError("batch", f"integer entry {name!r} needs high (values lie in [0, high)), "
                                            f"e.g. the vocabulary size; got {entry.high!r}")
        out[str(name)] = Spec(shape, dtype, entry.high if integer else None)
    return out


def _known_dtype(dtype: Any) -> bool:
    try:
        jnp.dtype(dtype)
    except (TypeError, ValueError):
        return False
    return True


def path_name(path: Sequence[Any]) -> str:
    """A pytree path as the parameter name rules match: keys and attribute names joined by "/"."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def flatten(tree: Any, what: str) -> tuple[dict[str, Any], Any]:
    """`{path name: array}` and the tree's structure; ModelConfigError naming a leaf that is no array."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat = {}
    for path, leaf in leaves:
        name = path_name(path) or "(root)"
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise ModelConfigError(what, f"the leaf at {name!r} is a {type(leaf).__name__}, not an array (keep "
                                         "settings out of the tree, or mark them static)")
        flat[name] = leaf
    return flat, treedef


def takes(fn: Any, name: str) -> bool:
    """Whether the callable `fn` accepts the keyword argument `name`."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def block_names(names: Sequence[str]) -> tuple[str, ...]:
    """`remat_blocks` checked: class names or regular expressions over module paths."""
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
        raise ModelConfigError("remat_blocks", f"{names!r}: a list of block class names or path patterns")
    for n in names:
        try:
            re.compile(n)
        except re.error as exc:
            raise ModelConfigError("remat_blocks", f"{n!r} is not a regular expression: {exc}") from exc
    return tuple(names)


def block_matches(names: Sequence[str], class_name: str, path: str) -> bool:
    """Whether a module of class `class_name` at `path` is one of the blocks `names` names."""
    return any(n == class_name or re.fullmatch(n, path) for n in names)


class Carried(nnx.Variable):
    """State a model carries from step to step that is not trained (batch statistics, Haiku state)."""


class _Static:
    """A value held by identity in the model's graph (a tree structure, a partitioned-off module)."""

    def __init__(self, value: Any):
        self.value = value


class TreeModel(nnx.Module):
    """A parameter tree and its loss as an NNX module (see the module's docstring)."""

    def __init__(self, workload: "TreeWorkload", cfg: Yours, *, dtype: Any, block_wrap: BlockWrap, rngs: nnx.Rngs):
        policy = block_wrap.policy if isinstance(block_wrap, Remat) else None
        self.remat = isinstance(block_wrap, Remat)
        wrap = workload.style_wrap(policy) if self.remat and workload.names_blocks else None
        params, state = workload.tree_init(cfg, rngs.params(), wrap)
        flat, self.params_def = flatten(params, "parameters")
        self.param_names = tuple(flat)  # the tree's leaf order (the dicts below may be iterated sorted)
        self.params = nnx.data({k: nnx.Param(v.astype(jnp.float32) if jnp.issubdtype(v.dtype, jnp.floating) else v)
                                for k, v in flat.items()})
        flat_state, self.state_def = flatten(state, "state")
        self.state_names = tuple(flat_state)
        self.state = nnx.data({k: Carried(v) for k, v in flat_state.items()})
        self.rngs = nnx.Rngs(dropout=rngs.dropout())
        self.workload, self.cfg, self.dtype, self.policy, self.wrap = workload, cfg, dtype, policy, _Static(wrap)

    def __call__(self, batch: Batch) -> jax.Array:
        """The loss of `batch` (float32), the carried state updated in place."""
        dtype = self.dtype

        def cast(x: jax.Array) -> jax.Array:
            return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

        params = jax.tree.unflatten(self.params_def, [cast(self.params[k][...]) for k in self.param_names])
        state = jax.tree.unflatten(self.state_def, [self.state[k][...] for k in self.state_names])
        batch = {k: cast(v) for k, v in batch.items()}
        key = self.rngs.dropout()
        workload, cfg, wrap = self.workload, self.cfg, self.wrap.value

        def loss(p: Any, s: Any, b: Batch, k: jax.Array) -> tuple[jax.Array, Any]:
            return workload.tree_loss(cfg, p, s, b, k, wrap)

        if self.remat and wrap is None:  # no blocks named: one checkpoint around the whole loss
            loss = jax.checkpoint(loss, policy=self.policy)
        value, new_state = loss(params, state, batch, key)
        for name, leaf in flatten(new_state, "state")[0].items():
            if name in self.state:
                self.state[name].value = leaf
        return jnp.asarray(value).astype(jnp.float32)


class Declared:
    """What the adapters share: the batch as the user declares it (`spec`), their own data, and the figures
    read from the program (checkpoint names, the typical product width)."""

    spec: dict[str, Spec]
    style = ""
    presets: Mapping[str, Yours]
    _data: Callable[[int], Iterable[Batch]] | None = None
    _names: tuple[str, ...] | None = None  # checkpoint names the user declares (None: read from the program)

    def batch_shapes(self, cfg: Yours, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {k: jax.ShapeDtypeStruct((batch_size, *s.shape), jnp.dtype(s.dtype)) for k, s in self.spec.items()}

    def value_high(self, cfg: Yours, name: str) -> int:
        return self.spec[name].high or 2

    def data_iterator(self, cfg: Yours, batch_size: int) -> Iterator[Batch] | None:
        return None if self._data is None else checked_batches(self, cfg, self._data, batch_size)  # type: ignore[arg-type]

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        return self._names if self._names is not None else self.facts(self.presets["default"]).names  # type: ignore[attr-defined]

    def matmul_width(self, cfg: Yours) -> int:
        return self.facts(cfg).width  # type: ignore[attr-defined]

    def describe(self, cfg: Yours) -> dict[str, Any]:
        return {"workload": self.name, "style": self.style, "model": cfg.model}  # type: ignore[attr-defined]


class TreeWorkload(Declared, Workload):
    """A workload from a parameter tree and a loss (subclasses: one per style, in its own module).

    `name`: how plans and history call it; `batch`: the batch (see `batch_spec`); `partition_rules`:
    `(regex, axes)` pairs for tensor parallelism (module docstring); `make_batch`: an optional jittable
    `(key, batch_size) -> batch` of learnable data (default: random values of the batch's shapes); `data`:
    an optional `batch_size -> iterable of batches` of the team's own data (host arrays), which a measured
    run then trains on instead."""

    gathers_in_blocks = False
    fp8_linears = False
    default_preset = custom_base = "default"
    style = ""  # the adapter's style, e.g. "linen"

    def __init__(self, name: str, batch: Mapping[str, Any], *, description: str = "",
                 partition_rules: Sequence[tuple[str, Sequence[str | None]]] = (),
                 make_batch: Callable[[jax.Array, int], Batch] | None = None,
                 data: Callable[[int], Iterable[Batch]] | None = None, user_code: Sequence[Any] = ()):
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,99}", name):
            raise ModelConfigError("name", f"{name!r}: letters, digits and _ . : / - (at most 100)")
        self.name = name
        self.description = description or f"{name} ({self.style})"
        self.presets = {"default": Yours(name)}
        self.spec = batch_spec(batch)
        self.partition_rules = _rules(partition_rules)
        self.tensor_parallel = bool(self.partition_rules)
        self._make_batch, self._data = make_batch, data
        self._user_code = tuple(c for c in (*user_code, make_batch, data) if c is not None)

    # -- what a style says ------------------------------------------------------------------------
    takes_block_wrap = False  # whether the user's code takes the style's block wrap
    remat_blocks: tuple[str, ...] = ()  # blocks named by class or path that the adapter wraps (Haiku, Equinox)

    @property
    def names_blocks(self) -> bool:
        """Whether the plan can recompute the model block by block: its code takes `block_wrap`, or the
        adapter wraps the blocks the user named (`remat_blocks`)."""
        return self.takes_block_wrap or bool(self.remat_blocks)

    blocks_hint = ""  # how a style's user names blocks besides block_wrap, for the reason above

    def style_wrap(self, policy: Any) -> Callable[[Any], Any]:
        """What the user's code receives as `block_wrap` under a remat policy (default: a function wrap)."""
        return lambda fn: jax.checkpoint(fn, policy=policy)

    def tree_init(self, cfg: Yours, key: jax.Array, wrap: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def tree_loss(self, cfg: Yours, params: Any, state: Any, batch: Batch, key: jax.Array,
                  wrap: Any) -> tuple[jax.Array, Any]:
        raise NotImplementedError

    def example(self, batch_size: int = 1) -> Batch:
        """A batch of zeros, for the inits that trace the model on one."""
        return {k: jnp.zeros((batch_size, *s.shape), s.dtype) for k, s in self.spec.items()}

    # -- the Workload protocol --------------------------------------------------------------------
    def build(self, cfg: Yours, *, dtype: Any, block_wrap: BlockWrap, rngs: nnx.Rngs) -> TreeModel:
        return TreeModel(self, cfg, dtype=dtype, block_wrap=block_wrap, rngs=rngs)

    def loss(self, model: TreeModel, batch: Batch) -> jax.Array:
        return model(batch)

    def make_batch(self, cfg: Yours, key: jax.Array, batch_size: int) -> Batch:
        if self._make_batch is not None:
            return self._make_batch(key, batch_size)
        return super().make_batch(cfg, key, batch_size)

    def remat_unavailable(self, remat: str, saved_names: tuple[str, ...] = ()) -> str | None:
        if remat == "full" and not self.names_blocks:
            return (f"{self.name} names no blocks (its code takes no block_wrap{self.blocks_hint}), so the plan "
                    "cannot recompute block by block; around the whole loss, saving nothing saves no memory")
        return super().remat_unavailable(remat, saved_names)

    def tensor_parallel_spec(self, path: tuple[str, ...], shape: tuple[int, ...], shards: int,
                             axis: str) -> jax.sharding.PartitionSpec:
        name = path[-1] if path else ""
        for pattern, axes in self.partition_rules:
            if pattern.search(name):
                if len(axes) != len(shape):
                    raise ModelConfigError("partition_rules", f"{pattern.pattern!r} gives {len(axes)} axes to "
                                                              f"{name!r}, which has {len(shape)} dimensions {shape}")
                # one mesh axis splits one dimension: the first the rule names for it that the GPUs divide
                split = next((i for i, (a, d) in enumerate(zip(axes, shape)) if a in TENSOR_AXES and d % shards == 0),
                             None)
                return jax.sharding.PartitionSpec(*[axis if i == split else None for i in range(len(shape))])
        return jax.sharding.PartitionSpec()

    def code_files(self) -> list[str]:
        """The files of the user's own code (their edits recompile; `compile_cache.workload_fingerprint`)."""
        files = []
        for obj in self._user_code:
            target = obj if inspect.isfunction(obj) or inspect.isclass(obj) else type(obj)
            try:
                source = inspect.getsourcefile(target)
            except TypeError:
                source = None
            if source:
                files.append(source)
        return files


def _rules(rules: Sequence[tuple[str, Sequence[str | None]]]) -> tuple[tuple[re.Pattern[str], tuple[Any, ...]], ...]:
    out = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ModelConfigError("partition_rules", f"{rule!r}: each rule is (regex over the parameter path, "
                                                      "a tuple of logical axis names or None per dimension)")
        pattern, axes = rule
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise ModelConfigError("partition_rules", f"{pattern!r} is not a regular expression: {exc}") from exc
        axes = tuple(axes) if not isinstance(axes, str) else (axes,)
        if not all(a is None or isinstance(a, str) for a in axes):
            raise ModelConfigError("partition_rules", f"{pattern!r}: axes are names or None, got {axes!r}")
        out.append((compiled, axes))
    return tuple(out)
