"""Equinox: a module made from a key, and a loss of the module and a batch.

    from workloads.equinox import Equinox
    WORKLOAD = Equinox("my-gpt", make=lambda key: GPT(config, key=key),
                       loss=lambda model, batch, key: lm_loss(model, batch, key),
                       batch={"tokens": ((256,), "int32", 50_257)})

The module's floating arrays are its parameters, its other arrays carried state, the rest static
(`eqx.partition`). `make` may take a keyword `block_wrap` (`eqx.filter_checkpoint(fn, policy=...)`
under a remat policy, the function itself without) for the blocks it calls; or name the blocks with
`remat_blocks` (submodule classes, or patterns over their paths such as `blocks/\d+`): each is then
recomputed through `eqx.filter_checkpoint`, with no change to the code. equinox is an optional
extra (`pip install -r requirements-styles.txt`), imported only here. See `workloads/tree.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, final

import jax

from workloads.base import Batch, ModelConfigError
from workloads.tree import TreeWorkload, Yours, block_matches, block_names, path_name, takes


@final
class Equinox(TreeWorkload):
    style = "equinox"

    blocks_hint = ", nor names remat_blocks"

    def __init__(self, name: str, *, make: Callable[..., Any], loss: Callable[..., jax.Array],
                 batch: Mapping[str, Any], remat_blocks: Sequence[str] = (), **options: Any):
        import equinox as eqx  # reason: equinox is optional; imported only by those who bring an Equinox model

        self._eqx = eqx
        if not callable(make) or not callable(loss):
            raise ModelConfigError("equinox", "make must be a function key -> module and loss a function "
                                              "(model, batch, key) -> scalar")
        self.make_fn, self.loss_fn = make, loss
        self.takes_block_wrap = takes(make, "block_wrap")
        self.remat_blocks = block_names(remat_blocks)
        super().__init__(name, batch, user_code=(make, loss), **options)

    def style_wrap(self, policy: Any) -> Callable[[Any], Any]:
        return lambda fn: self._eqx.filter_checkpoint(fn, policy=policy)

    def _make(self, key: jax.Array, wrap: Any) -> Any:
        return self.make_fn(key, block_wrap=wrap or (lambda f: f)) if self.takes_block_wrap else self.make_fn(key)

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a workload lives as long as the process
    def _static(self, wrap: Any) -> Any:
        """The module's non-array part (layers' settings, activation functions), from an abstract make."""
        eqx = self._eqx
        shaped = eqx.filter_eval_shape(self._make, jax.random.key(0), wrap)
        return eqx.partition(shaped, lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct))[1]

    def tree_init(self, cfg: Yours, key: jax.Array, wrap: Any) -> tuple[Any, Any]:
        eqx = self._eqx
        arrays, _ = eqx.partition(self._make(key, wrap), eqx.is_array)
        return eqx.partition(arrays, eqx.is_inexact_array)

    def tree_loss(self, cfg: Yours, params: Any, state: Any, batch: Batch, key: jax.Array,
                  wrap: Any) -> tuple[jax.Array, Any]:
        model = self._eqx.combine(params, state, self._static(wrap))
        if self.remat_blocks and not self.takes_block_wrap and wrap is not None:
            model = self._wrapped(model, wrap)
        return self.loss_fn(model, batch, key), state

    def _wrapped(self, model: Any, wrap: Callable[[Any], Any]) -> Any:
        """`model` with each submodule named in `remat_blocks` (its class, or a pattern over its path such as
        `blocks/\d+`) replaced by one whose call is recomputed by `wrap` (`eqx.filter_checkpoint`)."""
        eqx = self._eqx
        found: list[tuple[Any, ...]] = []

        def walk(node: Any, path: tuple[Any, ...]) -> None:
            children, _ = jax.tree_util.tree_flatten_with_path(
                node, is_leaf=lambda x: x is not node and isinstance(x, eqx.Module))
            for sub, child in children:
                if not isinstance(child, eqx.Module):
                    continue
                where = path + tuple(sub)
                if block_matches(self.remat_blocks, type(child).__name__, path_name(where)):
                    found.append(where)
                else:
                    walk(child, where)

        walk(model, ())
        if not found:
            return model
        nodes = [_at(model, where) for where in found]
        cls = _checkpointed(eqx)
        return eqx.tree_at(lambda m: [_at(m, where) for where in found], model,
                           [cls(node, wrap) for node in nodes])


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    """The node of `tree` at a key path (attribute names, sequence indices, dict keys)."""
    for key in path:
        if hasattr(key, "name"):
            tree = getattr(tree, key.name)
        elif hasattr(key, "idx"):
            tree = tree[key.idx]
        else:
            tree = tree[key.key]
    return tree


@functools.lru_cache(maxsize=1)
def _checkpointed(eqx: Any) -> type:
    """A module that calls `inner` through `wrap` (made once equinox is imported)."""

    class Checkpointed(eqx.Module):
        inner: Any
        wrap: Any = eqx.field(static=True)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.wrap(lambda module, *a: module(*a, **kwargs))(self.inner, *args)

    return Checkpointed
