"""Equinox: a module made from a key, and a loss of the module and a batch.

    from workloads.equinox import Equinox
    WORKLOAD = Equinox("my-gpt", make=lambda key: GPT(config, key=key),
                       loss=lambda model, batch, key: lm_loss(model, batch, key),
                       batch={"tokens": ((256,), "int32", 50_257)})

The module's floating arrays are its parameters, its other arrays carried state, the rest static
(`eqx.partition`). `make` may take a keyword `block_wrap` (`eqx.filter_checkpoint(fn, policy=...)`
under a remat policy, the function itself without) for the blocks it calls. equinox is an optional
extra (`pip install -r requirements-styles.txt`), imported only here. See `workloads/tree.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, final

import jax

from workloads.base import Batch, ModelConfigError
from workloads.tree import TreeWorkload, Yours, takes


@final
class Equinox(TreeWorkload):
    style = "equinox"

    def __init__(self, name: str, *, make: Callable[..., Any], loss: Callable[..., jax.Array],
                 batch: Mapping[str, Any], **options: Any):
        import equinox as eqx  # reason: equinox is optional; imported only by those who bring an Equinox model

        self._eqx = eqx
        if not callable(make) or not callable(loss):
            raise ModelConfigError("equinox", "make must be a function key -> module and loss a function "
                                              "(model, batch, key) -> scalar")
        self.make_fn, self.loss_fn = make, loss
        self.takes_block_wrap = takes(make, "block_wrap")
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
        return self.loss_fn(model, batch, key), state
