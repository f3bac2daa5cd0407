"""Haiku: a function of the batch that returns the loss, built from Haiku modules (`hk.transform`).

    from workloads.haiku import Haiku
    WORKLOAD = Haiku("my-transformer", loss=loss_fn, batch={"tokens": ((512,), "int32", 32_000)})

`loss(batch) -> scalar` runs inside `hk.transform` (`hk.transform_with_state` with `state=True`, for
modules that keep state such as `hk.BatchNorm`); it may take a keyword `block_wrap` to wrap each block's
function (`hk.remat(fn, policy=...)` under a remat policy, the function itself without), or name its
blocks with `remat_blocks` (module classes, or patterns over module names such as `transformer/~/block_\d+`):
each call of such a module is then recomputed through `hk.remat`, with no change to the code. dm-haiku is an
optional extra (`pip install -r requirements-styles.txt`), imported only here. See `workloads/tree.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, final

import jax

from workloads.base import Batch, ModelConfigError
from workloads.tree import TreeWorkload, Yours, block_matches, block_names, takes


@final
class Haiku(TreeWorkload):
    style = "haiku"

    blocks_hint = ", nor names remat_blocks"

    def __init__(self, name: str, *, loss: Callable[..., jax.Array], batch: Mapping[str, Any], state: bool = False,
                 remat_blocks: Sequence[str] = (), **options: Any):
        import haiku as hk  # reason: dm-haiku is optional; imported only by those who bring a Haiku model

        self._hk = hk
        if not callable(loss):
            raise ModelConfigError("haiku", "loss must be a function batch -> scalar, built from Haiku modules")
        self.loss_fn, self.with_state = loss, state
        self.takes_block_wrap = takes(loss, "block_wrap")
        self.remat_blocks = block_names(remat_blocks)
        super().__init__(name, batch, user_code=(loss,), **options)

    def style_wrap(self, policy: Any) -> Callable[[Any], Any]:
        return lambda fn: self._hk.remat(fn, policy=policy)

    def _transformed(self, wrap: Any) -> Any:
        fn = self.loss_fn
        if self.takes_block_wrap:
            inner = wrap or (lambda f: f)
            fn = lambda batch: self.loss_fn(batch, block_wrap=inner)  # noqa: E731
        elif self.remat_blocks and wrap is not None:
            fn = self._intercepted(fn, wrap)
        return self._hk.transform_with_state(fn) if self.with_state else self._hk.transform(fn)

    def _intercepted(self, fn: Callable[..., Any], wrap: Callable[[Any], Any]) -> Callable[..., Any]:
        """`fn` with each call of a module named in `remat_blocks` (its class, or a pattern over its module
        name, e.g. "transformer/~/block_3") recomputed by `wrap` (`hk.remat` with the policy)."""
        hk, named = self._hk, self.remat_blocks

        def interceptor(next_f, args, kwargs, context):
            module = context.module
            if context.method_name == "__call__" and block_matches(named, type(module).__name__, module.module_name):
                return wrap(lambda *a: next_f(*a, **kwargs))(*args)
            return next_f(*args, **kwargs)

        def intercepted(batch: Any) -> Any:
            with hk.intercept_methods(interceptor):
                return fn(batch)

        return intercepted

    def tree_init(self, cfg: Yours, key: jax.Array, wrap: Any) -> tuple[Any, Any]:
        out = self._transformed(wrap).init(key, self.example())
        return out if self.with_state else (out, {})

    def tree_loss(self, cfg: Yours, params: Any, state: Any, batch: Batch, key: jax.Array,
                  wrap: Any) -> tuple[jax.Array, Any]:
        t = self._transformed(wrap)
        if self.with_state:
            return t.apply(params, state, key, batch)
        return t.apply(params, key, batch), state
