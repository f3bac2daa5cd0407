"""Measured serving on this machine's first device: a stream of requests of mixed prompt and
generation lengths, served in static batches by the decode path (workloads/transformer.py
`Decoder.prefill` / `extend`), with the work waited for before every clock read.

- Prompts are padded to a bucket (a power of two from 16, at most the cache's length: the longest
  prompt plus the longest generation), so a stream compiles one prefill program
  per bucket and one decode-step program, all before the timed stream (the warm-up); compiles during
  the stream are counted (`recompiles`) and should be 0.
- TTFT: from a batch's start to its first tokens on the host; TPOT: each decode step of the batch,
  its tokens on the host (the one copy a server needs per token). Greedy or temperature sampling.
- The figures say where they were measured (backend and device kind): on the CPU backend they are
  CPU figures, not a GPU's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import resource
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from migration.common import ConfigError
from migration.config.serving import ServeRunRequest
from migration.running.checkpoint import restore_params
from workloads import get_workload
from workloads.kv_cache import cache_dtype
from workloads.decoding import cache_shapes, empty_cache, serving_decoder
from workloads.transformer import TransformerConfig

MIN_BUCKET = 16
# The serving precision's logits against float32's on the same weights and tokens: the RMS of the
# difference over the RMS of float32's logits, at most this (measured on random and trained tiny
# models: bf16 about 0.3-1%, int8 weight-only about 1-2%; the bounds leave room for larger models).
LOGIT_TOLERANCE = {"bf16": 0.03, "fp16": 0.01, "int8": 0.05}


WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}  # a served parameter's bytes, by serving precision


def memory_floor(req: ServeRunRequest) -> tuple[int, int]:
    """What a run needs at least: (the weights in its serving precision, the KV cache of its largest batch
    at its longest prompt and generation), in bytes. Arithmetic: nothing is allocated."""
    cfg = get_workload(req.workload).config(req.preset, req.model)
    dtype = cache_dtype(req.precision, req.kv_cache)
    shapes = cache_shapes(cfg, max(req.batches), req.prompt_range[1] + req.gen_range[1], dtype)
    cache = cfg.n_layers * sum(math.prod(shape) for shape in shapes) * jnp.dtype(dtype).itemsize
    return get_workload(req.workload).param_count(cfg) * WEIGHT_BYTES[req.precision], cache


def memory_budget(memory_fraction: float) -> tuple[int, str]:
    """The memory a run may fill on this machine's first device, and where the figure comes from: the
    limit the device reports at the run's share (a GPU), else the host's memory at that share, never
    more than the host has available (the CPU backend, on a box other processes share)."""
    stats = jax.devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"the device's limit at a {memory_fraction:.0%} share"
    info = {}
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            info[name] = int(rest.split()[0]) * 1024
    total, available = info.get("MemTotal", 16 * 2**30), info.get("MemAvailable", 16 * 2**30)
    return int(min(total * memory_fraction, available)), (f"{memory_fraction:.0%} of the host's memory, at most what "
                                                          "it has available")


def check_memory(req: ServeRunRequest, memory_fraction: float) -> None:
    """ConfigError("batches") when the run's weights and largest batch's KV cache alone exceed what it may
    fill here: refused before anything is allocated (a large request would otherwise press the host's
    memory, which the server and other users' jobs share)."""
    weights, cache = memory_floor(req)
    budget, source = memory_budget(memory_fraction)
    if weights + cache > budget:
        gb = lambda n: f"{n / 1e9:,.2f} GB"  # noqa: E731
        raise ConfigError("batches", f"batch {max(req.batches):,} at {req.prompt_range[1]:,} + {req.gen_range[1]:,} "
                                     f"tokens needs {gb(weights)} of weights and {gb(cache)} of KV cache, over the "
                                     f"{gb(budget)} this run may use ({source}); measure fewer sequences or shorter "
                                     "requests")


def bucket(n: int, cap: int) -> int:
    """The prompt length `n` padded to: the next power of two from MIN_BUCKET, at most `cap`."""
    return min(cap, max(MIN_BUCKET, 1 << max(0, n - 1).bit_length()))


class Server:
    """A model, its compiled prefill programs (one per bucket) and decode step, for batches of `batch`."""

    def __init__(self, cfg: TransformerConfig, precision: str, batch: int, max_len: int, temperature: float, seed: int,
                 state: Any = None, kv_cache: str = "auto"):
        self.cfg, self.dtype, self.batch, self.max_len = cfg, cache_dtype(precision, kv_cache), batch, max_len
        graphdef, self.state = nnx.split(serving_decoder(cfg, precision, nnx.Rngs(seed), state))

        def pick(logits: jax.Array, key: jax.Array) -> jax.Array:
            if temperature <= 0:
                return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
            return jax.random.categorical(key, logits[:, -1].astype(jnp.float32) / temperature).astype(jnp.int32)

        def prefill(st, tokens, last, cache, key):
            logits, cache = nnx.merge(graphdef, st).prefill(tokens, last, cache)
            return pick(logits, key), cache

        def decode(st, token, start, cache, key):
            logits, cache = nnx.merge(graphdef, st).extend(token[:, None], start, cache)
            return pick(logits, key), cache

        self.prefill = jax.jit(prefill, donate_argnums=3)
        self.decode = jax.jit(decode, donate_argnums=3)
        self.key = jax.random.key(seed)

    def compiled(self) -> int:
        return self.prefill._cache_size() + self.decode._cache_size()

    def serve(self, prompts: list[list[int]], gens: list[int]) -> dict[str, Any]:
        """One static batch (rows beyond the requests are padding): timings and the generated tokens."""
        b = self.batch
        lengths = [len(p) for p in prompts] + [1] * (b - len(prompts))
        width = bucket(max(lengths), self.max_len)
        tokens = np.zeros((b, width), np.int32)
        for row, p in enumerate(prompts):
            tokens[row, :len(p)] = p
        last = jnp.asarray(np.array(lengths, np.int32) - 1)
        cache = empty_cache(self.cfg, b, self.max_len, self.dtype)
        self.key, sub = jax.random.split(self.key)
        t0 = time.perf_counter()
        token, cache = self.prefill(self.state, jnp.asarray(tokens), last, cache, sub)
        out = [np.asarray(token)]  # the first tokens on the host: the wait is the prefill
        ttft = time.perf_counter() - t0
        steps = []
        position = last + 1
        for _ in range(max(gens) - 1):
            self.key, sub = jax.random.split(self.key)
            t = time.perf_counter()
            token, cache = self.decode(self.state, token, position, cache, sub)
            out.append(np.asarray(token))  # this step's tokens on the host
            steps.append(time.perf_counter() - t)
            position = position + 1
        generated = np.stack(out, axis=1)
        return {"ttft_s": ttft, "tpot_s": steps, "tokens": [generated[r, :g].tolist() for r, g in enumerate(gens)]}


def requests_of(req: ServeRunRequest, vocab: int) -> list[tuple[list[int], int]]:
    """The stream: prompt and generation lengths drawn uniformly from their ranges, random tokens."""
    rng = np.random.default_rng(req.seed)
    out = []
    for _ in range(req.requests):
        n = int(rng.integers(req.prompt_range[0], req.prompt_range[1] + 1))
        out.append((rng.integers(0, vocab, n).tolist(), int(rng.integers(req.gen_range[0], req.gen_range[1] + 1))))
    return out


def peak_memory() -> tuple[int, str]:
    """The device's peak bytes in use so far, and where that figure comes from."""
    stats = jax.devices()[0].memory_stats() or {}
    if stats.get("peak_bytes_in_use") is not None:
        return int(stats["peak_bytes_in_use"]), "measured: device memory_stats() (peak so far)"
    # the CPU backend keeps its arrays in this process's memory
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS (host memory, peak so far)"


def measure_batch(cfg: TransformerConfig, req: ServeRunRequest, batch: int, stream: list[tuple[list[int], int]],
                  widths: list[int], max_len: int, state: Any) -> dict[str, Any]:
    """The stream served in static batches of `batch`, after a warm-up that compiles every bucket's
    prefill and the decode step; the figures of one row of the run."""
    server = Server(cfg, req.precision, batch, max_len, req.temperature, req.seed, state, req.kv_cache)
    t0 = time.perf_counter()
    for width in widths:  # warm-up: every bucket's prefill and the decode step, once each
        server.serve([[0] * width], [2])
    warmup_s, compiled = time.perf_counter() - t0, server.compiled()
    ttft, tpot, generated = [], [], 0
    t0 = time.perf_counter()
    for i in range(0, len(stream), batch):
        chunk = stream[i:i + batch]
        result = server.serve([p for p, _ in chunk], [g for _, g in chunk])
        ttft.append(result["ttft_s"])
        tpot += result["tpot_s"]
        generated += sum(len(t) for t in result["tokens"])
    wall = time.perf_counter() - t0
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else math.nan  # noqa: E731
    peak, source = peak_memory()
    return {"batch": batch, "warmup_s": warmup_s, "programs_compiled": compiled,
            "recompiles": server.compiled() - compiled, "requests": len(stream), "batches": len(ttft),
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "tpot_p50_s": pct(tpot, 50),
            "tpot_p90_s": pct(tpot, 90), "tokens_per_s": generated / wall, "generated_tokens": generated,
            "peak_memory_bytes": peak, "peak_memory_source": source}


def logits_check(cfg: TransformerConfig, precision: str, state: Any, seed: int, tokens: np.ndarray | None = None
                 ) -> dict[str, Any]:
    """The serving precision's logits against float32's, the same weights (`state`, or the seed's
    random ones) and tokens (`tokens`, or 4 random sequences of up to 64): the RMS of the difference
    over float32's RMS, the largest difference, the share of positions whose top token agrees, and
    whether the RMS ratio is within LOGIT_TOLERANCE."""
    if tokens is None:
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, cfg.vocab_size, (4, min(64, cfg.seq_len)), dtype=np.int32)
    tokens = jnp.asarray(tokens)
    ref = serving_decoder(cfg, "fp32", nnx.Rngs(seed), state)(tokens).astype(jnp.float32)
    out = serving_decoder(cfg, precision, nnx.Rngs(seed), state)(tokens).astype(jnp.float32)
    rms = lambda x: float(jnp.sqrt(jnp.mean(jnp.square(x))))  # noqa: E731
    ratio = rms(out - ref) / max(rms(ref), 1e-30)
    return {"precision": precision, "tokens": int(tokens.size), "rms_ratio": ratio,
            "max_abs_diff": float(jnp.max(jnp.abs(out - ref))),
            "top1_agreement": float(jnp.mean(jnp.argmax(out, -1) == jnp.argmax(ref, -1))),
            "tolerance": LOGIT_TOLERANCE[precision], "within": ratio <= LOGIT_TOLERANCE[precision]}


def kv_cache_check(cfg: TransformerConfig, req: ServeRunRequest, stream: list[tuple[list[int], int]], max_len: int,
                   state: Any) -> dict[str, Any]:
    """An fp8 KV cache against the compute dtype's: the stream's first batch of 4 served greedily with each,
    the share of generated tokens that agree (position by position) and of sequences that agree entirely."""
    chunk = stream[:4]
    prompts, gens = [p for p, _ in chunk], [g for _, g in chunk]
    out = {kv: Server(cfg, req.precision, len(chunk), max_len, 0.0, req.seed, state, kv).serve(prompts, gens)["tokens"]
           for kv in ("auto", "fp8")}
    pairs = [(a, b) for x, y in zip(out["auto"], out["fp8"]) for a, b in zip(x, y)]
    return {"kv_cache": "fp8", "against": str(jnp.dtype(cache_dtype(req.precision))), "sequences": len(chunk),
            "tokens": len(pairs), "token_agreement": sum(a == b for a, b in pairs) / max(1, len(pairs)),
            "sequence_agreement": sum(x == y for x, y in zip(out["auto"], out["fp8"])) / max(1, len(chunk))}


def serve_run(req: ServeRunRequest, state: Any = None) -> dict[str, Any]:
    """The measured stream, one row per batch size in `req.batches` (ascending: the peak memory so
    far is then the largest batch's), and, below float32, the logits check of the precision.
    `state`: the model's float32 parameters, else `req.checkpoint`'s, else random ones from `req.seed`."""
    cfg = get_workload(req.workload).config(req.preset, req.model)
    if req.checkpoint and state is None:
        cfg, state, _meta = restore_params(req.checkpoint)
    max_len = req.prompt_range[1] + req.gen_range[1]  # the cache: the longest prompt and generation (checked)
    stream = requests_of(req, cfg.vocab_size)
    widths = sorted({bucket(n, max_len) for n in range(req.prompt_range[0], req.prompt_range[1] + 1)})
    rows = [measure_batch(cfg, req, b, stream, widths, max_len, state) for b in sorted(req.batches)]
    device = jax.devices()[0]
    check = None if req.precision == "fp32" else logits_check(cfg, req.precision, state, req.seed)
    return {"request": dataclasses.asdict(req), "backend": jax.default_backend(), "device_kind": device.device_kind,
            "weights": "checkpoint" if state is not None else f"random (seed {req.seed})", "buckets": widths,
            "rows": rows, "recompiles": sum(r["recompiles"] for r in rows), "logits_check": check,
            "kv_cache_check": kv_cache_check(cfg, req, stream, max_len, state) if req.kv_cache == "fp8" else None}
