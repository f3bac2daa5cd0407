"""Haiku: a function of the batch that returns the loss, built from Haiku modules (`hk.transform`).

    from workloads.haiku import Haiku
    WORKLOAD = Haiku("my-transformer", loss=loss_fn, batch={"tokens": ((512,), "int32", 32_000)})

`loss(batch) -> scalar` runs inside `hk.transform` (`hk.transform_with_state` with `state=True`, for
modules that keep state such as `hk.BatchNorm`); it may take a keyword `block_wrap` to wrap each block's
function (`hk.remat(fn, policy=...)` under a remat policy, the function itself without). dm-haiku is an
optional extra (`pip install -r requirements-styles.txt`), imported only here. See `workloads/tree.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, final

import jax

from workloads.base import Batch, ModelConfigError
from workloads.tree import TreeWorkload, Yours, takes


@final
class Haiku(TreeWorkload):
    style = "haiku"

    def __init__(self, name: str, *, loss: Callable[..., jax.Array], batch: Mapping[str, Any], state: bool = False,
                 **options: Any):
        import haiku as hk  # reason: dm-haiku is optional; imported only by those who bring a Haiku model

        self._hk = hk
        if not callable(loss):
            raise ModelConfigError("haiku", "loss must be a function batch -> scalar, built from Haiku modules")
        self.loss_fn, self.with_state = loss, state
        self.takes_block_wrap = takes(loss, "block_wrap")
        super().__init__(name, batch, user_code=(loss,), **options)

    def style_wrap(self, policy: Any) -> Callable[[Any], Any]:
        return lambda fn: self._hk.remat(fn, policy=policy)

    def _transformed(self, wrap: Any) -> Any:
        fn = self.loss_fn
        if self.takes_block_wrap:
            inner = wrap or (lambda f: f)
            fn = lambda batch: self.loss_fn(batch, block_wrap=inner)  # noqa: E731
        return self._hk.transform_with_state(fn) if self.with_state else self._hk.transform(fn)

    def tree_init(self, cfg: Yours, key: jax.Array, wrap: Any) -> tuple[Any, Any]:
        out = self._transformed(wrap).init(key, self.example())
        return out if self.with_state else (out, {})

    def tree_loss(self, cfg: Yours, params: Any, state: Any, batch: Batch, key: jax.Array,
                  wrap: Any) -> tuple[jax.Array, Any]:
        t = self._transformed(wrap)
        if self.with_state:
            return t.apply(params, state, key, batch)
        return t.apply(params, key, batch), state
