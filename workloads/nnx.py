"""Flax NNX: a module made from `nnx.Rngs`, and a loss of the module and a batch.

    from workloads.nnx import NNX
    WORKLOAD = NNX("my-model", make=lambda rngs: MyModel(config, rngs=rngs),
                   loss=lambda model, batch: cross_entropy(model(batch["x"]), batch["label"]),
                   batch={"x": ((28, 28), "float32"), "label": ((), "int32", 10)})

`make` may take the keywords `dtype` (the compute dtype of the plan's precision) and `block_wrap` (a
function applied to each block's `__call__`: `nnx.remat` with the policy, the call itself without; the
call takes the block first, so FSDP gathers the block's weights inside it, as for the built-in models).
Without `dtype`, the floating parameters are cast to the compute dtype at the step boundary. `data`: an
optional `batch_size -> iterable of batches` of the team's own data, which a measured run trains on. A built-in
family is the same thing written as a `Workload` subclass with analytic overrides (workloads/base.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, final

import jax
import jax.numpy as jnp
from flax import nnx

from workloads.base import Batch, BlockWrap, ModelConfigError, Workload
from workloads.tree import Declared, Yours, batch_spec, takes


class _Holder(nnx.Module):
    """The user's module and the compute dtype its parameters are cast to in the loss."""

    def __init__(self, inner: nnx.Module, dtype: Any, cast: bool):
        self.inner, self.dtype, self.cast = inner, dtype, cast


@final
class NNX(Declared, Workload):
    style = "nnx"
    default_preset = custom_base = "default"

    def __init__(self, name: str, *, make: Callable[..., nnx.Module], loss: Callable[[Any, Batch], jax.Array],
                 batch: Mapping[str, Any], description: str = "", checkpoint_names: tuple[str, ...] | None = None,
                 data: Callable[[int], Iterable[Batch]] | None = None):
        if not callable(make) or not callable(loss):
            raise ModelConfigError("nnx", "make must be a function rngs -> nnx.Module and loss a function "
                                          "(model, batch) -> scalar")
        self.name, self.description = name, description or f"{name} (nnx)"
        self.presets = {"default": Yours(name)}
        self.make_fn, self.loss_fn = make, loss
        self.spec = batch_spec(batch)
        self.takes_dtype, self.takes_block_wrap = takes(make, "dtype"), takes(make, "block_wrap")
        self.gathers_in_blocks = self.takes_block_wrap
        self._names, self._data = checkpoint_names, data

    def build(self, cfg: Yours, *, dtype: Any, block_wrap: BlockWrap, rngs: nnx.Rngs) -> nnx.Module:
        kw = {"dtype": dtype} if self.takes_dtype else {}
        if self.takes_block_wrap:
            kw["block_wrap"] = block_wrap
        return _Holder(self.make_fn(rngs=rngs, **kw), dtype, cast=not self.takes_dtype)

    def loss(self, model: _Holder, batch: Batch) -> jax.Array:
        inner = model.inner
        if model.cast:
            dtype = model.dtype
            graphdef, params, rest = nnx.split(inner, nnx.Param, ...)
            params = jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)
            inner = nnx.merge(graphdef, params, rest)
        return jnp.asarray(self.loss_fn(inner, batch)).astype(jnp.float32)

    def remat_unavailable(self, remat: str, saved_names: tuple[str, ...] = ()) -> str | None:
        if remat != "none" and not self.takes_block_wrap:
            return f"{self.name}'s make takes no block_wrap, so no block of it can be recomputed"
        return super().remat_unavailable(remat, saved_names)

    def code_files(self) -> list[str]:
        return [f for f in (inspect.getsourcefile(fn) for fn in (self.make_fn, self.loss_fn)
                            if inspect.isfunction(fn)) if f]
