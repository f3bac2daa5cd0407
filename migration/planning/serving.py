"""Serving plans: a decoder model served on a GPU it may not have. For each batch of concurrent
requests (prompt `prompt_len` tokens, `gen_len` generated), the two programs a server runs, the
prefill of the batch's prompts and one decode step over the KV cache, are compiled for the target
without the device (a deviceless XLA GPU compile, as the training planner does), and read for:

- memory: peak bytes of each program (weights, KV cache, workspace), the KV cache as compiled (the
  donated bytes the decode step updates in place) beside the arithmetic 2 x layers x kv heads x head
  size x tokens x batch x bytes, and whether the larger peak fits the target's budget;
- time: the predicted time to first token (the prefill program) and per output token (the decode
  program) from their kernels against the target's peak and bandwidth (planning/steptime.py), beside
  the bandwidth limit no decode step can beat: the weights it reads whole (all but the tables it gathers
  rows of) and the whole cache, read once per token; beside it the bytes the compiled decode step moves.

The batch is static: its prompts are prefilled together, then decoded together; the cache holds
prompt + generation positions per request. Over `gpus` GPUs of one node the model is tensor-parallel
(Megatron's split, workloads/transformer.py `tensor_parallel_spec`): heads and hidden units divided
among the GPUs, the KV cache split on its kv-head axis, two all-reduces per layer over the node's
link; memory, KV-cache bytes and the bandwidth limit are per GPU.
Needs the planner's environment (running/worker_env.planner_environment) when it compiles.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from migration.common import compiled_peak_bytes
from migration.config.serving import SERVE_LIMITS, ServeRequest
from migration.hardware import GPU_SPECS, GpuSpec, link_bandwidth
from migration.planning.hlo_cost import read_program
from migration.planning.memory import deviceless_devices
from migration.planning.steptime import predict
from workloads import get_workload
from workloads.kv_cache import cache_dtype, cache_layout
from workloads.transformer import (CUDNN_HEAD_DIM_MAX, TransformerConfig, cache_shape,
                                   serving_decoder, tensor_parallel_shardings)

MODEL_AXIS = "model"

MAX_BATCH = SERVE_LIMITS["batch"][1]


def kv_cache_bytes(cfg: TransformerConfig, batch: int, tokens: int, itemsize: int) -> int:
    """Keys and values of every layer: 2 x layers x kv heads x head size x tokens x batch x bytes."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * tokens * batch * itemsize


def serving_config(req: ServeRequest, spec: GpuSpec) -> TransformerConfig:
    """The model as served: the request's dimensions (`req` checked by config.serving.serve_request),
    and cuDNN's fused attention for the prefill where
    the target runs it (compute capability 8.0+, bf16 or fp16, head size a multiple of 8 up to 128)."""
    cfg = get_workload(req.workload).config(req.preset, req.model)  # a checked request (config/serving.py)
    fused = (spec.compute_capability >= (8, 0) and req.precision in ("bf16", "fp16", "int8") and cfg.head_dim % 8 == 0
             and cfg.head_dim <= CUDNN_HEAD_DIM_MAX and "attention" not in req.model)
    return dataclasses.replace(cfg, attention="cudnn" if fused else cfg.attention)


def serving_mesh(devices: list[Any]) -> jax.sharding.Mesh:
    """The tensor-parallel mesh over `devices` (one node's GPUs)."""
    return jax.sharding.Mesh(np.array(devices), (MODEL_AXIS,))


def cache_sharding(mesh: jax.sharding.Mesh, layout: tuple[str, ...]) -> jax.sharding.NamedSharding:
    """A layer's KV cache split on its kv-head axis (kv_cache.cache_layout), as the keys and values
    projections are."""
    axes = [MODEL_AXIS if a == "kv_head" else None for a in layout]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))


def _abstract_state(cfg: TransformerConfig, precision: str, mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
    """The model's graph and its state as abstract arrays placed over `mesh`, as a server holds them
    (serving_decoder, laid out for the mesh's GPUs)."""
    shards = mesh.shape[MODEL_AXIS]
    graphdef, state = nnx.split(nnx.eval_shape(lambda: serving_decoder(cfg, precision, nnx.Rngs(0), shards=shards)))
    placed = tensor_parallel_shardings(state, mesh, MODEL_AXIS)
    return graphdef, jax.tree.map(lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where),
                                  state, placed)


def _bytes_per_device(leaves: list[jax.ShapeDtypeStruct]) -> int:
    return sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize for s in leaves)


def _gathered_bytes(cfg: TransformerConfig, state: Any) -> int:
    """One GPU's bytes of the tables a decode step only gathers rows of (an untied input embedding, a
    learned position table): held in memory, not read whole per token."""
    tables = [] if cfg.tied_embeddings else [state["embed"]["embedding"]]
    if cfg.positions == "learned":
        tables.append(state["positions"]["embedding"])
    return _bytes_per_device(tables)


def compile_programs(cfg: TransformerConfig, precision: str, batch: int, prompt_len: int, max_len: int,
                     mesh: jax.sharding.Mesh, kv_cache: str = "auto") -> dict[str, Any]:
    """The prefill and decode-step programs of `batch` sequences, compiled for `mesh`'s devices
    (serving_mesh); `weights_bytes` is one GPU's share of the parameters, `weights_read_bytes` the part of
    it a decode step reads whole (all but the tables it gathers rows of)."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    dtype = cache_dtype(precision, kv_cache)
    graphdef, state = _abstract_state(cfg, precision, mesh)
    split = cache_sharding(mesh, cache_layout(cfg.attention, dtype))
    layer = jax.ShapeDtypeStruct(cache_shape(cfg, batch, max_len, dtype), dtype, sharding=split)
    cache = {"k": [layer] * cfg.n_layers, "v": [layer] * cfg.n_layers}
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated)  # noqa: E731

    def prefill(st, tokens, last, cache):
        return nnx.merge(graphdef, st).prefill(tokens, last, cache)

    def decode(st, token, start, cache):
        return nnx.merge(graphdef, st).extend(token, start, cache)

    out = (replicated, {"k": [split] * cfg.n_layers, "v": [split] * cfg.n_layers})  # the logits whole on every GPU, the cache where it was
    compiled = {
        "prefill": jax.jit(prefill, donate_argnums=3, out_shardings=out).lower(
            state, ints(batch, prompt_len), ints(batch), cache).compile(),
        "decode": jax.jit(decode, donate_argnums=3, out_shardings=out).lower(
            state, ints(batch, 1), ints(batch), cache).compile(),
    }
    weights = _bytes_per_device(jax.tree.leaves(state))
    return {"programs": compiled, "weights_bytes": weights, "weights_read_bytes": weights - _gathered_bytes(cfg, state)}


def program_figures(compiled: Any, spec: GpuSpec, link_bytes_per_s: float | None) -> dict[str, Any]:
    """One GPU's figures of a compiled program: peak, donated and workspace bytes, predicted seconds
    (its collectives over `link_bytes_per_s`)."""
    stats = compiled.memory_analysis()
    kernels = read_program(compiled.as_text())
    timing = predict(kernels, spec, link_bytes_per_s)
    return {"peak_bytes": compiled_peak_bytes(compiled), "donated_bytes": int(stats.alias_size_in_bytes),
            "temp_bytes": int(stats.temp_size_in_bytes), "seconds": timing.seconds, "flops": timing.flops,
            "communication_s": timing.communication_s,
            "bytes": sum(k.bytes for k in kernels if k.kind in ("matmul", "attention", "convolution", "memory"))}


def serve_row(req: ServeRequest, cfg: TransformerConfig, spec: GpuSpec, mesh: Any, batch: int) -> dict[str, Any]:
    """One batch size's figures, per GPU where the model is split (see the module's docstring)."""
    itemsize = jnp.dtype(cache_dtype(req.precision, req.kv_cache)).itemsize  # of the KV cache
    max_len = req.prompt_len + req.gen_len
    made = compile_programs(cfg, req.precision, batch, req.prompt_len, max_len, mesh, req.kv_cache)
    link = link_bandwidth(req.target, 1, req.gpus)[0] if req.gpus > 1 else None
    prefill = program_figures(made["programs"]["prefill"], spec, link)
    decode = program_figures(made["programs"]["decode"], spec, link)
    kv = kv_cache_bytes(cfg, batch, max_len, itemsize) // req.gpus  # kv heads divide among the GPUs
    peak = max(prefill["peak_bytes"] or 0, decode["peak_bytes"] or 0)
    budget = int(spec.memory_bytes * req.memory_fraction)
    needed = made["weights_read_bytes"] + kv  # what a decode step must read, once
    limit = needed / spec.bandwidth_bytes_per_s  # no decode step beats reading it once
    return {"batch": batch, "gpus": req.gpus, "weights_bytes": made["weights_bytes"], "kv_cache_bytes": kv,
            "kv_cache_bytes_compiled": decode["donated_bytes"], "prefill_peak_bytes": prefill["peak_bytes"],
            "decode_peak_bytes": decode["peak_bytes"], "predicted_peak_bytes": peak, "budget_bytes": budget,
            "fits": peak <= budget, "predicted_ttft_s": prefill["seconds"], "predicted_tpot_s": decode["seconds"],
            "decode_communication_s": decode["communication_s"], "bandwidth_limit_tpot_s": limit,
            "tokens_per_s_per_gpu": batch / decode["seconds"] / req.gpus, "tpot_over_limit": decode["seconds"] / limit,
            "weights_read_bytes": made["weights_read_bytes"], "decode_bytes": decode["bytes"],
            "decode_bytes_over_needed": decode["bytes"] / needed}


def serve_plan(req: ServeRequest) -> dict[str, Any]:
    """The serving plan's rows (one per batch, in order) and the largest batch that fits."""
    spec = GPU_SPECS[req.target]
    cfg = serving_config(req, spec)
    mesh = serving_mesh(deviceless_devices(spec, 1, req.gpus))
    rows: dict[int, dict[str, Any]] = {}

    def row(batch: int) -> dict[str, Any]:
        if batch not in rows:
            rows[batch] = serve_row(req, cfg, spec, mesh, batch)
        return rows[batch]

    if req.batches:
        for b in req.batches:
            row(b)
    largest = _largest_fitting(row)
    if not req.batches:  # the table: powers of two up to the largest that fits, and that one
        b = 1
        while largest and b <= largest:
            row(b)
            b *= 2
    shown = [b for b in sorted(rows) if b <= largest or b in req.batches]
    link = link_bandwidth(req.target, 1, req.gpus)[1] if req.gpus > 1 else "one GPU: no collectives"
    return {"request": dataclasses.asdict(req), "model": dataclasses.asdict(cfg), "target": spec.name,
            "gpus": req.gpus, "link": link, "kv_cache": str(jnp.dtype(cache_dtype(req.precision, req.kv_cache))),
            "attention": cfg.attention, "budget_bytes": int(spec.memory_bytes * req.memory_fraction),
            "largest_batch": largest, "search_limit": MAX_BATCH, "compiled_batches": len(rows),
            "rows": [rows[b] for b in shown]}


def _largest_fitting(row) -> int:
    """The largest batch whose programs fit (at most MAX_BATCH). The peak grows about linearly with
    the batch (the cache and the prefill's activations), so batches 1 and 2 give a first guess of the
    edge; the guess is then bracketed by steps that double away from it and closed by bisection, so
    a wrong guess costs a few more compiles, never a wrong answer."""
    first = row(1)
    if not first["fits"]:
        return 0
    slope = row(2)["predicted_peak_bytes"] - first["predicted_peak_bytes"] if MAX_BATCH > 1 else 0
    if slope <= 0:
        guess = MAX_BATCH
    else:
        guess = 1 + int((first["budget_bytes"] - first["predicted_peak_bytes"]) // slope)
    guess = max(1, min(MAX_BATCH, guess))
    step = 1
    if row(guess)["fits"]:  # lo fits; look upwards for one that does not
        lo = guess
        while lo < MAX_BATCH and row(min(MAX_BATCH, lo + step))["fits"]:
            lo, step = min(MAX_BATCH, lo + step), step * 2
        if lo == MAX_BATCH:
            return lo
        hi = min(MAX_BATCH, lo + step)
    else:  # hi does not fit; look downwards for one that does (batch 1 does)
        hi = guess
        while not row(max(1, hi - step))["fits"]:
            hi, step = max(1, hi - step), step * 2
        lo = max(1, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if row(mid)["fits"] else (lo, mid)
    return lo
