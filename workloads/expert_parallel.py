"""Expert parallelism of the mixture-of-experts decoder (workloads/moe.py): the routed experts split along their
expert axis over the mesh axis `expert`, and the token slots sent to the GPUs (or TPU chips) that hold their
experts and back.

- Capacity dispatch: the slots, held in fixed-size buffers (sequence, expert, slot), resharded from by-sequence
  to by-expert (`expert_split`): XLA's partitioner makes that an all-to-all (GShard's).
- Dropless dispatch: each device's slots, sorted by expert, go to the experts' devices by a ragged all-to-all
  (`jax.lax.ragged_all_to_all`, MaxText's `sparse_matmul` with expert parallelism) into a receive buffer of the
  worst case (every slot that can reach one device: the expert axis x the local slots x min(top-k, local
  experts) / top-k, nothing ever dropped), are computed there by grouped products over the device's own
  experts, and come back by a second ragged all-to-all (`exchange_slots`).

XLA:CPU has no ragged all-to-all: on the CPU backend the same exchange runs as an all-gather of the rows and
offsets, each device picking what the ragged all-to-all would have written to it (`_gathered_exchange`); the
programs compiled for GPUs and TPUs hold the ragged all-to-all itself.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

# The mesh axis of expert parallelism, as migration/config/layouts.py names it (outside the batch's
# data and FSDP axes, inside which the tensor split comes).
EXPERT_AXIS, TENSOR_AXIS = "expert", "tensor"


def moe_expert_parallel_spec(path: tuple[str, ...], shape: tuple[int, ...], shards: int,
                             axis: str) -> jax.sharding.PartitionSpec:
    """Expert parallelism: the routed experts' up and down projections split along their expert axis
    (the third from the end: (layers, E, D, F) and (layers, E, F, D)); every other weight whole."""
    if len(path) > 1 and path[-2] == "experts" and path[-1] in ("up", "down") and len(shape) >= 3:
        split = len(shape) - 3
        if shape[split] % shards == 0:
            return jax.sharding.PartitionSpec(*[axis if i == split else None for i in range(len(shape))])
    return jax.sharding.PartitionSpec()


def expert_split(x: jax.Array, expert_dim: int, to_experts: bool = True) -> jax.Array:
    """`x` (groups first) held with its groups over the ambient mesh's batch axes and then, `to_experts`, with
    its experts over the expert axis and its groups over the batch axes left: that reshard is the
    all-to-all of the dispatch (GShard's; `to_experts=False` after the experts: the combine's, back).
    Unchanged without an expert axis (no expert parallelism)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return x
    names = mesh.axis_names
    outer = tuple(a for a in names[:names.index(EXPERT_AXIS)] if mesh.shape[a] > 1)  # the batch's outer axes

    def spec(groups: tuple[str, ...], experts: str | None) -> jax.sharding.PartitionSpec:
        dims: list = [None] * x.ndim
        dims[0] = groups or None
        dims[expert_dim] = experts
        return jax.sharding.PartitionSpec(*dims)

    by_example, by_expert = spec((*outer, EXPERT_AXIS), None), spec(outer, EXPERT_AXIS)
    first, then = (by_example, by_expert) if to_experts else (by_expert, by_example)
    return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(x, first), then)


def receive_rows(slots: int, n_experts: int, top_k: int, devices: int) -> int:
    """The rows of a device's receive buffer under dropless expert parallelism over `devices`: the most slots
    that can reach it, each device's `slots` (tokens x top-k) of which a token sends at most min(top-k, local
    experts) to one device: devices x slots x min(1, local experts / top-k) (MaxText's worst case,
    min(expert parallelism, experts / top-k) x an even share)."""
    local = n_experts // devices
    return devices * (slots // top_k) * min(top_k, local)


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=EXPERT_AXIS)


def _gathered_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """What `jax.lax.ragged_all_to_all` writes to this device, from every device's rows and offsets gathered
    (XLA:CPU has no ragged all-to-all): its output row r is sender i's row input_offsets[i][me] + r -
    output_offsets[i][me] where that lies within sender i's send_sizes[i][me] rows, else the `output` row."""
    del recv_sizes  # implied by the senders' sizes
    me = jax.lax.axis_index(EXPERT_AXIS)
    rows = jax.lax.all_gather(operand, EXPERT_AXIS)  # (P, m, D)
    starts, sizes, origins = (jax.lax.all_gather(a, EXPERT_AXIS)[:, me] for a in
                              (output_offsets, send_sizes, input_offsets))  # (P,): each sender's chunk for me
    r = jnp.arange(output.shape[0])
    inside = (r[None, :] >= starts[:, None]) & (r[None, :] < (starts + sizes)[:, None])  # (P, R)
    sender = jnp.argmax(inside, axis=0)
    source = jnp.clip(origins[sender] + r - starts[sender], 0, operand.shape[0] - 1)
    return jnp.where(jnp.any(inside, axis=0)[:, None], rows[sender, source], output)


def _exchange(*args):
    """The ragged all-to-all over the expert axis, as `jax.lax.ragged_all_to_all` (its gathered form on the
    CPU backend)."""
    return jax.lax.platform_dependent(*args, cpu=_gathered_exchange, default=_ragged)


def exchange_slots(rows: jax.Array, sizes: jax.Array, n_experts: int, top_k: int,
                   compute: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """Inside shard_map over a mesh with the expert axis: this device's slot rows (S, D), sorted by expert,
    with `sizes` (n_experts,) of them per expert, sent to the devices holding their experts (device j holds
    experts j x E/P to (j+1) x E/P - 1), computed there by `compute(rows, local_sizes)` (the device's rows
    sorted by its own experts, and their number per local expert; rows past their sum are padding), and
    returned: the computed rows (S, D') in the order of `rows`."""
    devices = jax.lax.axis_size(EXPERT_AXIS)
    me = jax.lax.axis_index(EXPERT_AXIS)
    local = n_experts // devices
    table = jax.lax.all_gather(sizes, EXPERT_AXIS)  # (P, E): each device's slots per expert
    by_device = table.reshape(devices, devices, local).sum(-1)  # [i, j]: slots device i sends to device j
    before = _exclusive_cumsum(by_device, axis=0)  # [i, j]: where device i's slots land in device j's buffer
    buffer = receive_rows(rows.shape[0], n_experts, top_k, devices)
    send, receive = by_device[me], by_device[:, me]
    received = _exchange(rows, jnp.zeros((buffer, rows.shape[1]), rows.dtype), _exclusive_cumsum(send), send,
                         before[me], receive)
    # received: sender 0's slots for this device's experts (by expert), then sender 1's, ...: by local expert
    chunks = jax.lax.dynamic_slice_in_dim(table, me * local, local, axis=1)  # (P, local)
    position = jnp.arange(buffer)
    expert = jnp.repeat(jnp.tile(jnp.arange(local), devices), chunks.reshape(-1), total_repeat_length=buffer)
    expert = jnp.where(position < jnp.sum(chunks), expert, local)  # the padding last
    order = jnp.argsort(expert, stable=True)
    out = compute(jnp.take(received, order, axis=0), jnp.sum(chunks, axis=0))
    out = jnp.zeros_like(out).at[order].set(out)  # back in the order received
    return _exchange(out, jnp.zeros((rows.shape[0], out.shape[1]), out.dtype), _exclusive_cumsum(receive), receive,
                     _exclusive_cumsum(by_device, axis=1)[:, me], send)
