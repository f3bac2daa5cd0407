"""Serving plans: a decoder model served on a GPU it may not have, by an engine that batches
continuously with chunked prefill over a paged KV cache (planning/capacity.py says which behaviour).
Two programs are compiled for the target without the device (a deviceless XLA GPU compile, as the
training planner does) and read:

- one prefill chunk: a prompt's `chunk` tokens (or the whole prompt when shorter), its workspace and its
  time per prompt token;
- one decode step of `n` running sequences over their cached positions (the mean a step reads), its
  workspace, its time, and the bytes its kernels move beside what it must read: the weights it reads
  whole (all but the tables it gathers rows of) and the cached keys and values, once.

The concurrency is what the KV cache's pages hold once the weights and the larger workspace are in the
budget (each sequence at its full length), capped by what a step's token budget sustains; it is
checked by compiling the decode step there. Rows at 1, a quarter, half and all of it (or the batches
asked for) give the step time (TPOT), the TTFT, the server's tokens and requests per second and the
bandwidth limit no decode step beats. Over `gpus` GPUs of one node the model is tensor-parallel
(Megatron's split, workloads/transformer.py `tensor_parallel_spec`): heads and hidden units divided
among the GPUs, the KV cache split on its kv-head axis, two all-reduces per layer over the node's
link; memory, KV-cache bytes and the bandwidth limit are per GPU.
Needs the planner's environment (running/worker_env.planner_environment) when it compiles.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from migration.config.serving import SERVE_LIMITS, ServeRequest
from migration.hardware import GPU_SPECS, GpuSpec, gpu_target_config, link_bandwidth
from migration.planning.capacity import (RequestClass, budget_bound_concurrency, chunked_attention_flops,
                                          kv_bound_concurrency, mix_figures, steady_state)
from migration.planning.compile_cache import CompileCache, cache_key, sources_fingerprint
from migration.planning.compiled import figures_of_program, serving_figures
from migration.planning.hlo_cost import unpack
from migration.planning.memory import deviceless_devices
from migration.planning.steptime import CALIBRATION, predict
from workloads import get_workload
from workloads.kv_cache import SERVING_DTYPES, cache_dtype
from migration.planning.routed_experts import (routed_kernels, routed_summary, routed_workspace_bytes,
                                                touched_experts)
from workloads.decoding import cache_layout_of, cache_shapes, serving_decoder
from workloads.expert_parallel import moe_expert_parallel_spec
from workloads.moe import MoeConfig, moe_tensor_parallel_spec
from workloads.transformer import CUDNN_HEAD_DIM_MAX, TransformerConfig, tensor_parallel_shardings

MODEL_AXIS = "model"

MAX_BATCH = SERVE_LIMITS["batch"][1]


def kv_cache_bytes(cfg: TransformerConfig, batch: int, tokens: int, itemsize: int) -> int:
    """Keys and values of every layer: 2 x layers x kv heads x head size x tokens x batch x bytes; MLA's
    compressed cache: layers x (latent + rotated key part) x tokens x batch x bytes (one copy for all heads)."""
    if is_latent(cfg):
        return cfg.n_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * tokens * batch * itemsize
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * tokens * batch * itemsize


def is_moe(cfg: TransformerConfig) -> bool:
    return isinstance(cfg, MoeConfig)


def is_latent(cfg: TransformerConfig) -> bool:
    """Multi-head latent attention: one compressed cache entry a position for all heads (workloads/mla.py)."""
    return is_moe(cfg) and cfg.attention_type == "mla"


def serving_config(req: ServeRequest, spec: GpuSpec) -> TransformerConfig:
    """The model as served: the request's dimensions (`req` checked by config.serving.serve_request),
    and cuDNN's fused attention for the prefill where
    the target runs it (compute capability 8.0+, bf16 or fp16, head size a multiple of 8 up to 128)."""
    cfg = get_workload(req.workload).config(req.preset, req.model)  # a checked request (config/serving.py)
    fused = (spec.compute_capability >= (8, 0) and req.precision in ("bf16", "fp16", "int8") and cfg.head_dim % 8 == 0
             and cfg.head_dim <= CUDNN_HEAD_DIM_MAX and "attention" not in req.model and not is_latent(cfg))
    return dataclasses.replace(cfg, attention="cudnn" if fused else cfg.attention)


def serving_mesh(devices: list[Any]) -> jax.sharding.Mesh:
    """The tensor-parallel mesh over `devices` (one node's GPUs)."""
    return jax.sharding.Mesh(np.array(devices), (MODEL_AXIS,))


def cache_sharding(mesh: jax.sharding.Mesh, layout: tuple[str, ...], shape: tuple[int, ...] | None = None
                   ) -> jax.sharding.NamedSharding:
    """A layer's KV cache split on its kv-head axis (kv_cache.cache_layout), as the keys and values
    projections are; whole on every GPU where that axis does not divide (MLA's one compressed head)."""
    heads = shape[layout.index("kv_head")] if shape is not None else mesh.shape[MODEL_AXIS]
    split = heads % mesh.shape[MODEL_AXIS] == 0
    axes = [MODEL_AXIS if a == "kv_head" and split else None for a in layout]
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))


def serving_spec(path: tuple[str, ...], shape: tuple[int, ...], shards: int, axis: str) -> jax.sharding.PartitionSpec:
    """A served MoE model's split over one node's GPUs: the routed experts whole among them where their number
    divides (expert parallelism), else by their hidden units; everything else as the dense decoder's."""
    if len(path) > 1 and path[-2:] == ("experts", "scales"):  # int8 experts' column scales (..., E, out)
        path, shape = (*path[:-1], "down"), (*shape, 1)  # split, or not, with their experts
        split = moe_expert_parallel_spec(path, shape, shards, axis)
        return jax.sharding.PartitionSpec(*split[:-1]) if any(split) else jax.sharding.PartitionSpec()
    split = moe_expert_parallel_spec(path, shape, shards, axis)
    return split if any(split) else moe_tensor_parallel_spec(path, shape, shards, axis)


def _abstract_state(cfg: TransformerConfig, precision: str, mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
    """The model's graph and its state as abstract arrays placed over `mesh`, as a server holds them
    (serving_decoder, laid out for the mesh's GPUs)."""
    shards = mesh.shape[MODEL_AXIS]

    def build():
        model = serving_decoder(cfg, precision, nnx.Rngs(0), shards=shards)
        if is_moe(cfg):
            model.routed_apart = True  # priced apart (planning/routed_experts.py); their weights stay held
        return model

    graphdef, state = nnx.split(nnx.eval_shape(build))
    placed = tensor_parallel_shardings(state, mesh, MODEL_AXIS, serving_spec if is_moe(cfg) else None)
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


def model_state(cfg: TransformerConfig, precision: str, mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """The served model's graph and abstract state over `mesh`, with one GPU's bytes of it: all of
    them (`weights_bytes`) and those a decode step reads whole (`weights_read_bytes`)."""
    graphdef, state = _abstract_state(cfg, precision, mesh)
    weights = _bytes_per_device(jax.tree.leaves(state))
    routed = _routed_bytes(cfg, state)
    return {"graphdef": graphdef, "state": state, "weights_bytes": weights, "routed_bytes": routed,
            "weights_read_bytes": weights - _gathered_bytes(cfg, state) - routed}


def _routed_bytes(cfg: TransformerConfig, state: Any) -> int:
    """One GPU's bytes of an MoE model's routed experts (their weights and int8 scales, not the router):
    a decode step reads only those of the experts its tokens touch (planning/routed_experts.py)."""
    if not is_moe(cfg):
        return 0
    experts = state["blocks"]["experts"]
    return _bytes_per_device(jax.tree.leaves({k: v for k, v in experts.items() if k != "router"}))


def lower_program(cfg: TransformerConfig, precision: str, model: dict[str, Any], mesh: jax.sharding.Mesh,
                  kind: str, batch: int, tokens: int, cache_len: int, kv_cache: str = "auto") -> Any:
    """A serving program lowered for `mesh`'s devices (serving_mesh): "prefill" (`batch` prompts of
    `tokens` tokens into an empty cache, logits of each one's last) or "decode" (one token for each of
    `batch` sequences), over a cache of `cache_len` positions a sequence, donated and updated in place."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    dtype = cache_dtype(precision, kv_cache)
    graphdef = model["graphdef"]
    layout = cache_layout_of(cfg, dtype)
    shapes = cache_shapes(cfg, batch, cache_len, dtype)
    splits = [cache_sharding(mesh, layout, shape) for shape in shapes]
    cache = {name: [jax.ShapeDtypeStruct(shape, dtype, sharding=where)] * cfg.n_layers
             for name, shape, where in zip(("k", "v"), shapes, splits)}
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated)  # noqa: E731

    def prefill(st, tokens, last, cache):
        return nnx.merge(graphdef, st).prefill(tokens, last, cache)

    def decode(st, token, start, cache):
        return nnx.merge(graphdef, st).extend(token, start, cache)

    out = (replicated, {"k": [splits[0]] * cfg.n_layers, "v": [splits[1]] * cfg.n_layers})  # logits whole on every GPU
    fn, width = (prefill, tokens) if kind == "prefill" else (decode, 1)
    return jax.jit(fn, donate_argnums=3, out_shardings=out).lower(
        model["state"], ints(batch, width), ints(batch), cache)


def program_figures(found: dict[str, Any], spec: GpuSpec, link_bytes_per_s: float | None,
                    more: tuple[Any, ...] = ()) -> dict[str, Any]:
    """One GPU's figures of a compiled program (compiled.serving_figures), with the kernels `more` priced
    apart from it: peak, donated and workspace bytes, predicted seconds (its collectives over `link_bytes_per_s`)."""
    kernels = unpack(found["kernels"]) + list(more)
    timing = predict(kernels, spec, link_bytes_per_s)
    return {"peak_bytes": found["peak_bytes"], "donated_bytes": found["donated_bytes"],
            "temp_bytes": found["temp_bytes"], "seconds": timing.seconds, "flops": timing.flops,
            "communication_s": timing.communication_s,
            "bytes": sum(k.bytes for k in kernels if k.kind in ("matmul", "attention", "convolution", "memory"))}


def kv_bytes_per_token(cfg: TransformerConfig, precision: str, kv_cache: str, gpus: int) -> float:
    """One GPU's bytes of one position's keys and values (kv heads divide among the GPUs; MLA's compressed
    cache, one head for all, is whole on each)."""
    return kv_cache_bytes(cfg, 1, 1, jnp.dtype(cache_dtype(precision, kv_cache)).itemsize) / (1 if is_latent(cfg) else gpus)


# The code that shapes a serving program beyond the workloads' (their decode path is in COMPILE_SOURCES).
SERVING_SOURCES = ("migration/planning/serving.py", "migration/config/serving.py", "migration/planning/routed_experts.py")


class _Planner:
    """The compiles of one serving plan, each once (see the module's docstring)."""

    def __init__(self, req: ServeRequest):
        self.req, self.spec = req, GPU_SPECS[req.target]
        self.cfg = serving_config(req, self.spec)
        self.mesh = serving_mesh(deviceless_devices(self.spec, 1, req.gpus))
        self.model = model_state(self.cfg, req.precision, self.mesh)
        self.link = link_bandwidth(req.target, 1, req.gpus)[0] if req.gpus > 1 else None
        self.figures = mix_figures(tuple(RequestClass(*c) for c in req.classes))
        self.per_token = kv_bytes_per_token(self.cfg, req.precision, req.kv_cache, req.gpus)
        self.context = max(1, round(self.figures.context_read))  # positions a decode step reads a sequence
        self.budget = int(self.spec.memory_bytes * req.memory_fraction)
        self.compiles = 0  # programs compiled for this plan
        self.cache_hits = 0  # programs whose figures the cache of compiled figures served
        self.cache = CompileCache()
        self.decodes: dict[int, dict[str, Any]] = {}
        self.act_bytes = jnp.dtype(SERVING_DTYPES[req.precision]).itemsize
        self.unit = "bf16" if req.precision == "int8" else req.precision

    def routed(self, tokens: int) -> tuple[Any, ...]:
        """The routed experts' kernels at `tokens` tokens a step, priced apart (planning/routed_experts.py)."""
        if not is_moe(self.cfg):
            return ()
        weight = 1 if self.req.precision == "int8" else self.act_bytes
        return tuple(routed_kernels(self.cfg, tokens, self.req.gpus, weight, self.act_bytes, self.unit))

    def routed_workspace(self, tokens: int) -> float:
        return routed_workspace_bytes(self.cfg, tokens, self.req.gpus, self.act_bytes) if is_moe(self.cfg) else 0.0

    def routed_read_bytes(self, n: int) -> float:
        """One GPU's bytes of the routed experts a decode step of `n` sequences reads: those touched."""
        if not is_moe(self.cfg):
            return 0.0
        return self.model["routed_bytes"] * touched_experts(self.cfg.n_experts, self.cfg.top_k, n) / self.cfg.n_experts

    def figures_of(self, kind: str, batch: int, tokens: int, cache_len: int) -> dict[str, Any]:
        """A serving program's figures, compiled once (a compile for the target kept in the cache of
        compiled figures, compile_cache.py, under a key of the model, target and program's settings)."""
        key = cache_key("serve", sources_fingerprint(SERVING_SOURCES), dataclasses.asdict(self.cfg),
                        gpu_target_config(self.spec), self.req.gpus, self.req.precision, self.req.kv_cache, kind,
                        batch, tokens, cache_len, os.environ.get("XLA_FLAGS", ""))
        found = self.cache.get(key)
        if found is not None:
            self.cache_hits += 1
        else:
            self.compiles += 1
            lowered = lower_program(self.cfg, self.req.precision, self.model, self.mesh, kind, batch, tokens,
                                    cache_len, self.req.kv_cache)
            found = {**figures_of_program(lowered, self.mesh.devices, gpu_target_config(self.spec), ("serving",),
                                          serving_figures, "compiled-serving", self.cache),
                     "where": "compiled-serving"}
            self.cache.put(key, found)
        return program_figures(found, self.spec, self.link, self.routed(batch * (tokens if kind == "prefill" else 1)))

    def chunk(self) -> dict[str, Any]:
        """The prefill chunk's program: its tokens, time, peak and workspace (beyond weights and its cache)."""
        tokens = min(self.req.chunk, max(c[1] for c in self.req.classes))
        fig = self.figures_of("prefill", 1, tokens, tokens)
        fig["tokens"] = tokens
        fig["workspace_bytes"] = max(0, (fig["peak_bytes"] or 0) - self.model["weights_bytes"]
                                     - tokens * self.per_token) + self.routed_workspace(tokens)
        return fig

    def decode(self, n: int) -> dict[str, Any]:
        if n not in self.decodes:
            fig = self.figures_of("decode", n, 1, self.context)
            fig["workspace_bytes"] = max(0, (fig["peak_bytes"] or 0) - self.model["weights_bytes"]
                                         - n * self.context * self.per_token) + self.routed_workspace(n)
            self.decodes[n] = fig
        return self.decodes[n]

    def held_bytes(self, n: int) -> float:
        """The KV pages `n` running sequences hold at their full lengths."""
        return n * self.figures.tokens_held * self.per_token

    def peak(self, n: int, chunk: dict[str, Any]) -> float:
        """A step's peak at `n` running sequences: weights, their pages, the larger workspace."""
        return self.model["weights_bytes"] + self.held_bytes(n) + max(self.decode(n)["workspace_bytes"],
                                                                      chunk["workspace_bytes"])

    def long_prompt_s(self) -> float:
        """Per finished request, the seconds its prompt's chunks spend attending to its earlier chunks
        (a prompt longer than a chunk; arithmetic on the attention FLOPs at the calibrated efficiency)."""
        cfg, req = self.cfg, self.req
        width = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim if is_latent(cfg) else cfg.head_dim
        flops = sum(share * chunked_attention_flops(prompt, req.chunk, cfg.n_layers, cfg.n_heads, width)
                    for share, prompt, _ in req.classes) / req.gpus
        unit = "bf16" if req.precision == "int8" else req.precision
        return flops / ((self.spec.peak_flops(unit) or self.spec.peak_flops("fp32")) * CALIBRATION.attention)


def serve_row(planner: _Planner, n: int, chunk: dict[str, Any]) -> dict[str, Any]:
    """The engine at `n` running sequences, per GPU where the model is split (see the module's docstring)."""
    req, model, spec = planner.req, planner.model, planner.spec
    decode = planner.decode(n)
    read = n * planner.context * planner.per_token  # what a step reads of the cache
    routed = planner.routed_read_bytes(n)
    needed = model["weights_read_bytes"] + routed + read
    limit = needed / spec.bandwidth_bytes_per_s  # no decode step beats reading it once
    state = steady_state(n, decode["seconds"], chunk["seconds"] / chunk["tokens"], planner.long_prompt_s(),
                         planner.figures, req.chunk)
    peak = planner.peak(n, chunk)
    return {"batch": n, "gpus": req.gpus, "weights_bytes": model["weights_bytes"],
            "weights_read_bytes": model["weights_read_bytes"] + routed, "routed_bytes_read": routed,
            "experts_touched": (touched_experts(planner.cfg.n_experts, planner.cfg.top_k, n)
                                if is_moe(planner.cfg) else None), "kv_cache_bytes": planner.held_bytes(n),
            "kv_cache_bytes_read": read, "kv_cache_bytes_compiled": decode["donated_bytes"],
            "decode_context": planner.context, "prefill_peak_bytes": chunk["peak_bytes"],
            "decode_peak_bytes": decode["peak_bytes"], "predicted_peak_bytes": peak, "budget_bytes": planner.budget,
            "fits": peak <= planner.budget, "predicted_ttft_s": state.ttft_s, "predicted_tpot_s": state.tpot_s,
            "decode_step_s": decode["seconds"], "prefill_tokens_per_step": state.prefill_tokens_per_step,
            "decode_communication_s": decode["communication_s"], "bandwidth_limit_tpot_s": limit,
            "tokens_per_s_per_gpu": state.output_tokens_per_s / req.gpus, "requests_per_s": state.requests_per_s,
            "tpot_over_limit": state.tpot_s / limit, "decode_bytes": decode["bytes"],
            "decode_bytes_over_needed": decode["bytes"] / needed}


ENGINE = ("continuous batching with chunked prefill over a paged KV cache (vLLM V1, SGLang, TensorRT-LLM "
          "in-flight batching): each step decodes one token of every running sequence and prefills prompt "
          "chunks in the rest of a {chunk:,}-token budget; a sequence is admitted with pages for its full length, "
          "so none is preempted; no queueing delay, prefix caching or speculative decoding")


def serve_plan(req: ServeRequest) -> dict[str, Any]:
    """The serving plan: the concurrency the KV cache and the token budget allow, checked by compiling
    the decode step there, and the engine's figures at rows of concurrency."""
    planner = _Planner(req)
    chunk = planner.chunk()
    first = planner.decode(1)
    workspace = max(chunk["workspace_bytes"], first["workspace_bytes"])
    free = planner.budget - planner.model["weights_bytes"] - workspace
    by_kv = kv_bound_concurrency(free, planner.per_token, planner.figures.tokens_held)
    by_budget = budget_bound_concurrency(req.chunk, planner.figures.prompt_per_output)
    n = min(by_kv, by_budget, MAX_BATCH)
    for _ in range(3):  # the decode workspace grows with the batch (its logits): step down until it fits
        if n < 1 or planner.peak(n, chunk) <= planner.budget:
            break
        over = planner.peak(n, chunk) - planner.budget
        n -= max(1, math.ceil(over / (planner.figures.tokens_held * planner.per_token)))
    n = max(n, 0)
    if n and planner.peak(n, chunk) > planner.budget:
        n = 0  # not reached in three steps: say so rather than guess
    shown = ((set(req.batches) or {1, n // 4, n // 2}) | {n}) - {0} or {1}  # the concurrency itself always a row
    rows = [serve_row(planner, b, chunk) for b in sorted(shown)]
    link = link_bandwidth(req.target, 1, req.gpus)[1] if req.gpus > 1 else "one GPU: no collectives"
    limits = {"kv_cache": by_kv, "token_budget": by_budget, "search_limit": MAX_BATCH}
    return {"request": dataclasses.asdict(req), "model": dataclasses.asdict(planner.cfg), "target": planner.spec.name,
            "gpus": req.gpus, "link": link, "kv_cache": str(jnp.dtype(cache_dtype(req.precision, req.kv_cache))),
            "attention": planner.cfg.attention, "budget_bytes": planner.budget, "largest_batch": n,
            "concurrency_limits": limits, "bound_by": min(limits, key=limits.get) if n else "memory",
            "engine": ENGINE.format(chunk=req.chunk), "chunk_tokens": chunk["tokens"],
            "chunk_workspace_bytes": chunk["workspace_bytes"], "decode_workspace_bytes": first["workspace_bytes"],
            "kv_bytes_per_token": planner.per_token, "tokens_held_per_sequence": planner.figures.tokens_held,
            "decode_context": planner.context, "prompt_per_output": planner.figures.prompt_per_output,
            "mix": [list(c) for c in req.classes], "search_limit": MAX_BATCH,
            "compiled_batches": planner.compiles, "cached_programs": planner.cache_hits, "rows": rows,
            # the weights alone, split evenly, against each GPU's budget: fewer GPUs cannot hold the model
            "fewest_gpus_for_weights": math.ceil(planner.model["weights_bytes"] * req.gpus / planner.budget),
            "mixture_of_experts": moe_summary(planner)}


def moe_summary(planner: _Planner) -> dict[str, Any] | None:
    """An MoE model's serving figures beside the rows: its counts, its attention's cache, its experts' layout."""
    cfg, req = planner.cfg, planner.req
    if not is_moe(cfg):
        return None
    workload = get_workload(req.workload)
    weight = 1 if req.precision == "int8" else planner.act_bytes
    return {"param_count": workload.param_count(cfg), "active_param_count": workload.active_param_count(cfg),
            "attention": ("multi-head latent: a compressed cache of latent + rotated key part a position, whole "
                          "on every GPU" if is_latent(cfg) else "grouped-query: keys and values split on kv heads"),
            **routed_summary(cfg, req.gpus, weight), "routed_bytes_per_gpu_held": planner.model["routed_bytes"]}
