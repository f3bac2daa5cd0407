"""A minimal hand-written training loop: the baseline `harness_overhead.py` compares the runner to.

Same model (built by the workload), same batch, same precision, same optimizer as the runner, but
none of its machinery: one `jax.jit` step over `nnx.split` state, no sharding, no events, no
per-step timing; N steps dispatched back to back and one `block_until_ready` at the end.

Usage (in a fresh process, JAX environment already set):
    python bench/minimal_loop.py WORKLOAD PRESET BATCH PRECISION STEPS WARMUP
prints one JSON line: {"steps_per_s": ...}
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from workloads import get_workload  # noqa: E402
from workloads.base import no_wrap  # noqa: E402

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def main(workload: str, preset: str, batch: int, precision: str, steps: int, warmup: int) -> None:
    w = get_workload(workload)
    cfg = w.config(preset)
    model = w.build(cfg, dtype=DTYPES[precision], block_wrap=no_wrap, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=1e-4))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, rest, opt_state, batch):
        def loss_fn(p):
            m = nnx.merge(graphdef, p, rest, copy=True)
            loss = w.loss(m, batch)
            return loss, nnx.split(m, nnx.Param, ...)[2]

        (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, loss

    step = jax.jit(step.__wrapped__, donate_argnums=(0, 1, 2))
    batches = [jax.jit(lambda k: w.make_batch(cfg, k, batch))(jax.random.key(i)) for i in range(min(steps, 16))]
    for i in range(warmup):
        params, rest, opt_state, loss = step(params, rest, opt_state, batches[i % len(batches)])
    jax.block_until_ready(loss)
    t0 = time.perf_counter()
    for i in range(steps):
        params, rest, opt_state, loss = step(params, rest, opt_state, batches[i % len(batches)])
    jax.block_until_ready((params, loss))
    print(json.dumps({"steps_per_s": steps / (time.perf_counter() - t0)}))


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), a[3], int(a[4]), int(a[5]))
