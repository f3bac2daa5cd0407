"""Flax Linen: a module, its `init` / `apply`, and a loss of its outputs.

    from workloads.linen import Linen
    WORKLOAD = Linen("lm1b", module=Transformer(config), inputs=("inputs",),
                     loss=lambda logits, batch: cross_entropy(logits, batch["targets"]),
                     batch={"inputs": ((256,), "int32", 30_000), "targets": ((256,), "int32", 30_000)})

`module`: a Linen module, or a function `block_wrap -> module` whose blocks the plan may recompute
(`block_wrap(Block)` is `nn.remat(Block, policy=...)` under a remat policy, `Block` itself without).
`inputs`: the batch entries passed to the module, in order (default: the first); `apply_kwargs` (e.g.
`{"train": True}`) and `init_kwargs` go to `apply` and `init`; `mutable`: collections `apply` updates
(e.g. `("batch_stats",)`); a `dropout` random stream is always given. See `workloads/tree.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, final

import jax

from workloads.base import Batch, ModelConfigError
from workloads.tree import TreeWorkload, Yours


@final
class Linen(TreeWorkload):
    style = "linen"

    def __init__(self, name: str, *, module: Any, loss: Callable[[Any, Batch], jax.Array], batch: Mapping[str, Any],
                 inputs: Sequence[str] | None = None, apply_kwargs: Mapping[str, Any] | None = None,
                 init_kwargs: Mapping[str, Any] | None = None, mutable: Sequence[str] = (), **options: Any):
        from flax import linen as nn  # reason: Linen is imported only by those who bring a Linen model

        self._nn = nn
        if not (isinstance(module, nn.Module) or callable(module)) or not callable(loss):
            raise ModelConfigError("linen", "module must be a flax.linen.Module (or block_wrap -> Module) and loss a "
                                            "function (outputs, batch) -> scalar")
        self.module, self.loss_fn = module, loss
        self.takes_block_wrap = not isinstance(module, nn.Module)
        super().__init__(name, batch, user_code=(type(module) if isinstance(module, nn.Module) else module, loss),
                         **options)
        self.inputs = tuple(inputs) if inputs else (next(iter(self.spec)),)
        unknown = [k for k in self.inputs if k not in self.spec]
        if unknown:
            raise ModelConfigError("inputs", f"{unknown[0]!r} is not an entry of the batch ({', '.join(self.spec)})")
        self.apply_kwargs = dict(apply_kwargs or {})
        self.init_kwargs = dict(self.apply_kwargs if init_kwargs is None else init_kwargs)
        self.mutable = tuple(mutable)

    def style_wrap(self, policy: Any) -> Callable[[Any], Any]:
        return lambda cls: self._nn.remat(cls, policy=policy)

    def _module(self, wrap: Any) -> Any:
        if not self.takes_block_wrap:
            return self.module
        return self.module(wrap or (lambda cls: cls))

    def tree_init(self, cfg: Yours, key: jax.Array, wrap: Any) -> tuple[Any, Any]:
        k_params, k_dropout = jax.random.split(key)
        example = self.example()
        variables = self._module(wrap).init({"params": k_params, "dropout": k_dropout},
                                            *(example[k] for k in self.inputs), **self.init_kwargs)
        variables = dict(variables)
        if "params" not in variables:
            raise ModelConfigError("linen", f"{self.name}'s module has no 'params' collection to train")
        return variables.pop("params"), variables

    def tree_loss(self, cfg: Yours, params: Any, state: Any, batch: Batch, key: jax.Array,
                  wrap: Any) -> tuple[jax.Array, Any]:
        out = self._module(wrap).apply({"params": params, **state}, *(batch[k] for k in self.inputs),
                                       rngs={"dropout": key}, mutable=list(self.mutable) or False, **self.apply_kwargs)
        if self.mutable:
            out, updates = out
            state = {**state, **updates}
        return self.loss_fn(out, batch), state
