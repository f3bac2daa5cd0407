"""Plain functions: `init(key) -> params` and `loss(params, batch, key) -> scalar`, trained with optax.

    from workloads.functional import Functional
    WORKLOAD = Functional("my-mlp", init=init, loss=loss, batch={"x": ((784,), "float32"),
                                                                 "label": ((), "int32", 10)})

`init` may also return `(params, state)` with `state=True`, and `loss` then takes `(params, state,
batch, key)` and returns `(scalar, new_state)`. Either function may take a keyword `block_wrap`:
`init` to build with it, `loss` to wrap each block's function (`block_wrap(fn)` is `jax.checkpoint(fn,
policy=...)` under a remat policy, the function itself without). See `workloads/tree.py` for what the
product decides on such a model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, final

import jax

from workloads.base import Batch, ModelConfigError
from workloads.tree import TreeWorkload, Yours, takes


@final
class Functional(TreeWorkload):
    style = "functional"

    def __init__(self, name: str, *, init: Callable[..., Any], loss: Callable[..., Any], batch: Mapping[str, Any],
                 state: bool = False, **options: Any):
        if not callable(init) or not callable(loss):
            raise ModelConfigError("functional", "init and loss must be functions")
        self.init_fn, self.loss_fn, self.with_state = init, loss, state
        self.takes_block_wrap = takes(loss, "block_wrap")
        super().__init__(name, batch, user_code=(init, loss), **options)

    def tree_init(self, cfg: Yours, key: jax.Array, wrap: Any) -> tuple[Any, Any]:
        out = self.init_fn(key, block_wrap=wrap or (lambda f: f)) if takes(self.init_fn, "block_wrap") else self.init_fn(key)
        return out if self.with_state else (out, {})

    def tree_loss(self, cfg: Yours, params: Any, state: Any, batch: Batch, key: jax.Array,
                  wrap: Any) -> tuple[jax.Array, Any]:
        kw = {"block_wrap": wrap or (lambda f: f)} if self.takes_block_wrap else {}
        if self.with_state:
            return self.loss_fn(params, state, batch, key, **kw)
        return self.loss_fn(params, batch, key, **kw), state
