"""Memory prediction for the planner: where a plan compiles (a catalog GPU without the device, or
this machine), and the per-device peak of the real train step for a (precision, remat, batch,
accumulation), compiled once and kept in the disk cache of compiled figures (`compile_cache.py`).

Runs inside a planner worker (JAX's environment set before import; see `migration/running/worker_env.py`).
The peak comes from compiling the same step a run uses (`migration/step/train.py`) on abstract inputs
and reading `memory_analysis()`. XLA's own rematerialisation pass is disabled for these compiles
by the worker's environment, so a "fits" never hides recomputation the user did not choose. Where
no compile for the target is possible, an analytic estimate stands in, labelled so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from migration.common import first_line, fmt_gib, is_oom
from migration.config.limits import CUSTOM_REMAT, REMAT_NAMED, parse_custom_remat
from migration.config.requests import PlanRequest, RunConfig
from migration.hardware import (
    nvidia_gpus,
    GPU_SPECS,
    GpuSpec,
    Links,
    compute_capability,
    fp32_matmul_precision,
    gpu_spec_for_device_kind,
    gpu_target_config,
    link_bandwidth,
    matmul_unit,
)
from migration.planning.compile_cache import CompileCache, cache_key, workload_fingerprint
from migration.planning.deployment import block_params
from migration.planning.compiled import figures_of_program, train_step_figures
from migration.planning.hlo_cost import Kernel, unpack
from migration.planning.search import ROWS_PER_SM_TO_FILL
from migration.config.layouts import parse_layout
from migration.config.limits import state_bytes_per_param
from migration.step.train import TrainProgram, abstract_batch, abstract_state, jit_step, make_mesh
from workloads import WORKLOADS, allow_references, get_workload, is_reference

Emit = Callable[..., None]
# Named activations each policy keeps for the backward pass, at the least: without remat, the q, k,
# v projections (attention's backward reads them), the attention output (the projection's weight
# gradient) and the MLP's hidden layer (its activation's backward); the dots policies keep the
# matmul outputs among those; a named policy keeps its names; offloading and full remat keep none
# on the device. Every policy keeps each block's input.
MUST_KEEP: dict[str, tuple[str, ...]] = {
    "none": ("query_proj", "kv_proj", "attention_out", "mlp_hidden"),
    "dots": ("query_proj", "kv_proj", "mlp_hidden"),
    "dots_no_batch": ("query_proj", "kv_proj", "mlp_hidden"),
    "save_dot_except_mlp": REMAT_NAMED["save_dot_except_mlp"],
    "save_qkv": REMAT_NAMED["save_qkv"],
}


def compile_memory(program: TrainProgram, mesh: Any, kernels: bool = False, per_node: int | None = None,
                   fp32_unit: str = "tf32", target: Any = None, where: str = "compiled-here",
                   cache: CompileCache | None = None) -> dict[str, Any]:
    """Peak bytes per device of the real train step compiled on abstract inputs for `mesh`'s devices,
    and the bytes of its state arguments per device (allocates nothing; raises what XLA raises, CompileOOM
    when the compiler finds it cannot fit). With `kernels`, the program's kernels and collectives too
    (hlo_cost.pack), for the step-time prediction of a GPU target (or a TPU slice: its fp32 products run as
    bf16 passes, `fp32_unit`). Each lowered program is compiled once (compiled.figures_of_program, kept
    under the deviceless `target` the devices stand for, with `where`: how its figures were made)."""
    lowered = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh))
    batch_bytes = sum(s.size * s.dtype.itemsize for s in program.batch_shapes().values()) // mesh.size
    return figures_of_program(lowered, mesh.devices, target, ("train", batch_bytes, kernels, per_node, fp32_unit),
                              lambda c: train_step_figures(c, batch_bytes, kernels, per_node, fp32_unit), where,
                              cache)


def compile_peak(program: TrainProgram, mesh: Any) -> int | None:
    return compile_memory(program, mesh)["peak_bytes"]


class CompileFailed(RuntimeError):
    """Compiling for the target failed for a reason other than memory."""


COMPILE_WORKERS_MAX = 3


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the system tells it, else the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def compile_workers() -> int:
    """Processes the planner may compile candidates in beside its own. An XLA GPU compile keeps about
    two cores busy (on a 2-core machine one extra worker took 0.96x and 1.09x the serial time in two
    runs of bench/planner_cost.py), so one worker per two cores beyond the first two, at most
    COMPILE_WORKERS_MAX ($MIGRATION_COMPILE_WORKERS overrides; 0: none)."""
    given = os.environ.get("MIGRATION_COMPILE_WORKERS", "").strip()
    if given.isdigit():
        return min(int(given), 8)
    return max(0, min(COMPILE_WORKERS_MAX, usable_cores() // 2 - 1))


def compile_pool(workers: int, workload: str) -> ProcessPoolExecutor:
    """Spawned processes the planner compiles in (candidates, the TPU side). A team's model named by reference
    (`package.module:NAME`) that this process has imported is importable there too: this process resolved it,
    so it allows references (the command line and run workers do; the app never plans one)."""
    carried = is_reference(workload) and workload in WORKLOADS
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=allow_references,
                               initargs=(carried,))


_ELSEWHERE: dict[str, "MemoryPredictor"] = {}


def _compile_elsewhere(req: PlanRequest, model: dict[str, Any], args: tuple[Any, ...]) -> dict[str, int | None]:
    """In a compile worker (a spawned process with the planner's environment): one candidate's
    compile, with a predictor per request kept for the worker's life."""
    key = json.dumps([req.to_dict(), model], sort_keys=True, default=str)
    if key not in _ELSEWHERE:
        _ELSEWHERE[key] = MemoryPredictor(req, lambda *a, **k: None, model=model, workers=0)
    return _ELSEWHERE[key]._compile(*args)


@dataclasses.dataclass(frozen=True)
class Target:
    """The device a plan is for: its memory, what it computes natively, its peak."""

    name: str
    spec: GpuSpec | None  # the catalog entry, when there is one
    device_memory_bytes: int
    budget_bytes: int
    budget_source: str
    bf16_native: bool
    compute_capability: tuple[int, int] | None
    platform: str  # "gpu" or "cpu"
    fill_rows: int  # rows that fill the device (see search.ROWS_PER_SM_TO_FILL)
    device_kind: str | None = None
    link_bytes_per_s: float | None = None  # slowest GPU-to-GPU link of the target (hardware.link_bandwidth)
    link_note: str = ""
    links: Links | None = None  # inside a node and between nodes: what each collective crosses

    def peak_flops(self, precision: str) -> float | None:
        """Dense peak per device for the precision (fp32 as the default matmul precision runs it)."""
        if self.spec is None:
            return None
        fp32 = fp32_matmul_precision(self.platform, self.compute_capability, None)
        return self.spec.peak_flops(matmul_unit(precision, fp32))


def resolve_target(req: PlanRequest) -> Target:
    if req.target != "local":
        spec = GPU_SPECS[req.target]
        link, link_note = link_bandwidth(spec.key, req.domains, req.domain, req.network_bytes_per_s)
        return Target(spec.name, spec, spec.memory_bytes, _budget(spec.memory_bytes * req.memory_fraction, req),
                      f"{fmt_gib(spec.memory_bytes)} from {spec.source}", spec.bf16_native, spec.compute_capability,
                      "gpu", spec.sm_count * ROWS_PER_SM_TO_FILL, None, link, link_note,
                      Links.of(spec.key, req.domains, req.network_bytes_per_s))
    device = jax.devices()[0]
    name = f"this machine: {device.device_kind} ({device.platform})"
    if device.platform == "gpu":
        return _local_gpu_target(device, name, req)
    total = _host_memory()
    return Target(name, None, total, _budget(total * req.memory_fraction, req),
                  f"{fmt_gib(total)} of host memory (/proc/meminfo): the CPU backend", True, None, "cpu",
                  (os.cpu_count() or 1) * ROWS_PER_SM_TO_FILL, device.device_kind)


def _local_gpu_target(device: Any, name: str, req: PlanRequest) -> Target:
    spec = gpu_spec_for_device_kind(device.device_kind)
    cc = compute_capability(device) or (0, 0)
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit:
        # The planner worker runs with XLA_PYTHON_CLIENT_MEM_FRACTION = the request's share, so the
        # limit the device reports is already this job's share of the card.
        share, total = int(limit), int(limit / req.memory_fraction)
        source = (f"bytes_limit {fmt_gib(limit)} reported by the device (memory_stats) at "
                  f"XLA_PYTHON_CLIENT_MEM_FRACTION={req.memory_fraction:.2f}")
    elif spec is not None:
        total = spec.memory_bytes
        share, source = int(total * req.memory_fraction), f"{fmt_gib(total)} from {spec.source} (the device reported no limit)"
    else:
        raise CompileFailed(f"{device.device_kind} reports no memory limit and is not in the catalog")
    share, source = free_share(share, source, nvidia_gpus(), nvml_index(device))
    sms = spec.sm_count if spec else int(getattr(device, "core_count", 0) or 100)
    link, link_note = link_bandwidth(spec.key, 1) if spec else (None, "unknown interconnect")
    return Target(name, spec, total, _budget(share, req), source, cc >= (8, 0), cc, "gpu",
                  sms * ROWS_PER_SM_TO_FILL, device.device_kind, link, link_note, Links(link))


def nvml_index(device: Any) -> int:
    """NVML's index of a local JAX GPU: its ordinal through CUDA_VISIBLE_DEVICES when that lists indices."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    local = int(getattr(device, "local_hardware_id", None) or getattr(device, "id", 0) or 0)
    if visible and all(v.isdigit() for v in visible) and local < len(visible):
        return int(visible[local])
    return local


def free_share(share: int, source: str, gpus: list[dict[str, Any]], index: int) -> tuple[int, str]:
    """The job's share capped by what NVML reports free on its GPU: on a shared GPU other processes
    already hold memory, and a plan that fits the share alone can run out of memory beside them."""
    gpu = next((g for g in gpus if g.get("index") == index), None)
    if gpu is None or gpu.get("free_bytes") is None:
        return share, source + "; free memory not known (no NVML): other processes' use not subtracted"
    free = int(gpu["free_bytes"])
    if free < share:
        return free, (f"{source}, capped at the {fmt_gib(free)} NVML reports free on GPU {index} (other processes "
                      f"hold {fmt_gib(gpu.get('used_by_other_processes_bytes') or gpu['used_bytes'])})")
    return share, f"{source}; {fmt_gib(free)} free on GPU {index} (NVML)"


def _budget(share: float, req: PlanRequest) -> int:
    return int(share * (1 - req.safety_margin))


def _host_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * 2**30


def deviceless_devices(spec: GpuSpec, nodes: int, per_node: int) -> list[Any]:
    """`nodes` x `per_node` devices of `spec` described without the devices (the CUDA plugin's
    topology for a deviceless compile); raises what the plugin raises where it cannot."""
    from jax.experimental import topologies  # reason: a JAX module read only where a target is planned

    return list(topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(spec),
                                             topology=f"1x{nodes}x{per_node}").devices)


class MemoryPredictor:
    """Per-device peak bytes of the train step for (precision, remat, batch, accumulation)."""

    def __init__(self, req: PlanRequest, emit: Emit, cache: CompileCache | None = None,
                 estimate_because: str | None = None, model: dict[str, Any] | None = None, workers: int | None = None):
        self.req = req
        self.model = dict(req.model if model is None else model)  # the dimension overrides compiled
        self.emit = emit
        self.state_bytes: dict[tuple[str, str, int, int, str], int | None] = {}
        # The kernels of each compiled candidate (a GPU compile only): what its step time is read from.
        self.programs: dict[tuple[str, str, int, int, str], list[Kernel]] = {}
        self.cache = cache or CompileCache()
        self.compiles = 0
        self.cache_hits = 0
        # With a budget, a candidate whose lower bound exceeds it is not compiled (`lower_bound`):
        # it is counted, and its figure is the bound ("at least").
        self.budget: int | None = None
        self.ruled_out = 0
        self.bounded: set[tuple[str, str, int, int, str]] = set()
        # Compile workers: candidates the search is likely to ask for next compile there meanwhile
        # (`prefetch`); `predict` collects them. None: as many as the cores allow.
        self.workers = compile_workers() if workers is None else workers
        self.parallel = 0  # compiles that ran in a compile worker
        self._pool: ProcessPoolExecutor | None = None
        self._inflight: dict[str, Future] = {}
        self.table: list[dict[str, Any]] = []
        if estimate_because:
            self.method, self.note, self.devices, self.target_id = (
                "estimate", f"analytic estimate: {estimate_because}", None, f"estimate:{req.target}")
        else:
            self.method, self.note, self.devices, self.target_id = self._setup()
        # A GPU program's kernels are read for its step time; a CPU-backend program says nothing of a GPU's.
        self.reads_kernels = self.method == "compiled-for-target" or (
            self.method == "compiled-local" and jax.default_backend() == "gpu")

    # -- where we compile ------------------------------------------------------------------
    def _setup(self) -> tuple[str, str, Any, str]:
        req = self.req
        if req.target == "local":
            devices = jax.devices()
            if len(devices) < req.gpus:
                raise ValueError(f"gpus: {req.gpus} requested but this machine has {len(devices)} "
                                 f"{devices[0].platform} device(s)")
            kind = devices[0].device_kind
            note = f"compiled for this machine's {kind} ({jax.default_backend()} backend)"
            if jax.default_backend() == "cpu":
                note += ("; a CPU-backend compile is not a GPU prediction (on CPU, remat savings do not "
                         "show in the memory analysis)")
            return "compiled-local", note, list(devices[: req.gpus]), f"local:{kind}"
        spec = GPU_SPECS[req.target]
        text = gpu_target_config(spec)
        per_node = req.gpus if req.nodes == 1 else req.node_gpus
        topology = f"1x{req.nodes}x{per_node}"
        try:
            mesh = deviceless_devices(spec, req.nodes, per_node)
        except Exception as exc:  # noqa: BLE001 - plugin missing or unable to describe the target: estimate instead
            return ("estimate", f"analytic estimate: no compile for {spec.name} was possible here ({first_line(exc)})",
                    None, f"estimate:{spec.key}")
        where = f"{req.nodes} nodes x {per_node} x {spec.name}" if req.nodes > 1 else f"{req.gpus} x {spec.name}"
        return ("compiled-for-target", f"compiled for {where} without the devices (deviceless XLA GPU compile of the "
                f"{req.gpus}-device program, topology {topology}; per-device figures)",
                mesh, hashlib.sha256((text + topology).encode()).hexdigest()[:16])

    def _key(self, precision: str, remat: str, batch: int, accum: int, sharding: str) -> str:
        return cache_key(workload_fingerprint(get_workload(self.req.workload)), self.method, self.target_id,
                         self.req.workload, self.req.preset, sorted(self.model.items()), precision, remat, batch,
                         accum, self.req.gpus, sharding, os.environ.get("XLA_FLAGS", ""),
                         *(() if self.req.mu_dtype == "float32" else (self.req.mu_dtype,)))

    # -- prediction ------------------------------------------------------------------------
    def predict(self, precision: str, remat: str, batch: int, accum: int = 1, record: bool = True,
                sharding: str = "replicated") -> int | None:
        """Peak bytes per device, or None when the compiler says it cannot fit at all."""
        key = self._key(precision, remat, batch, accum, sharding)
        hit = self.cache.get(key)
        t0 = time.perf_counter()
        bound = None
        if hit is not None:
            self.cache_hits += 1
            found = hit
        elif self.method == "estimate":
            found = self.estimate_memory(precision, remat, batch, accum, sharding)
            self.cache.put(key, {**found, "where": self.method})
        else:
            bound = self.lower_bound(precision, remat, batch, sharding) if self.budget is not None else None
            if bound is not None and bound > self.budget:  # over the budget whatever the compiler does
                self.ruled_out += 1
                self.bounded.add((sharding, remat, batch, accum, precision))
                found = {"peak_bytes": bound, "state_bytes": None}
            else:
                bound = None
                found = self._collect(key)
                if found is None:
                    found = self._compile(precision, remat, batch, accum, sharding)
                self.cache.put(key, {**found, "where": self.method})
        peak = found["peak_bytes"]
        self.state_bytes[(sharding, remat, batch, accum, precision)] = found.get("state_bytes")
        if found.get("kernels") is not None:
            self.programs[(sharding, remat, batch, accum, precision)] = unpack(found["kernels"])
        if record:
            row = {"sharding": sharding, "per_device_batch": batch, "remat": remat, "precision": precision,
                   "accumulation_steps": accum, "predicted_bytes": peak, "state_bytes": found.get("state_bytes"),
                   "cached": hit is not None, "lower_bound": bound is not None,
                   "seconds": round(time.perf_counter() - t0, 3)}
            self.table.append(row)
            self.emit("candidate", **row)
        return peak

    def prefetch(self, precision: str, remat: str, batch: int, accum: int = 1, sharding: str = "replicated") -> bool:
        """Start compiling a candidate in a compile worker, unless there is none, it is cached, already on
        its way, or ruled out by the lower bound; `predict` collects the result. True when started."""
        if self.method == "estimate" or not self.workers:
            return False
        key = self._key(precision, remat, batch, accum, sharding)
        if key in self._inflight or self.cache.get(key) is not None:
            return False
        if self.budget is not None and self.lower_bound(precision, remat, batch, sharding) > self.budget:
            return False
        try:
            if self._pool is None:
                self._pool = compile_pool(self.workers, self.req.workload)
            self._inflight[key] = self._pool.submit(_compile_elsewhere, self.req, self.model,
                                                    (precision, remat, batch, accum, sharding))
        except (OSError, RuntimeError, BrokenProcessPool):
            self.workers = 0  # no worker could start: compile here from now on
            return False
        return True

    def _collect(self, key: str) -> dict[str, int | None] | None:
        """A prefetched candidate's result (waiting for it), or None when it was not prefetched or its
        worker died (then it is compiled here). A compile that failed for the target raises here."""
        future = self._inflight.pop(key, None)
        if future is None:
            return None
        try:
            found = future.result()
        except BrokenProcessPool:
            self.workers = 0
            return None
        self.compiles += 1
        self.parallel += 1
        return found

    def close(self) -> None:
        """Stop the compile workers (candidates still compiling there are abandoned)."""
        if self._pool is not None:
            running = list((getattr(self._pool, "_processes", None) or {}).values())
            self._pool.shutdown(wait=False, cancel_futures=True)
            for process in running:  # a compile nobody will collect: stop it rather than wait for it
                process.terminate()
            self._pool = None
        self._inflight.clear()

    def _compile(self, precision: str, remat: str, batch: int, accum: int, sharding: str) -> dict[str, int | None]:
        cfg = RunConfig(workload=self.req.workload, preset=self.req.preset, model=self.model, per_device_batch=batch,
                        devices=self.req.gpus, precision=precision, remat=remat, accumulation_steps=accum,
                        sharding=sharding, mu_dtype=self.req.mu_dtype)
        self.compiles += 1
        try:
            mesh = make_mesh(self.devices, sharding)
            # collectives are read by the link domains their groups span (an NVL72 rack is one)
            return compile_memory(TrainProgram.from_config(cfg), mesh, kernels=self.reads_kernels,
                                  per_node=self.req.domain, target=self.target_id, where=self.method,
                                  cache=self.cache)
        except Exception as exc:  # noqa: BLE001 - XLA raises several types; memory is told apart by its message
            if is_oom(str(exc)):
                return {"peak_bytes": None, "state_bytes": None}
            raise CompileFailed(f"compiling for the target failed ({type(exc).__name__}: {first_line(exc)})") from exc

    def estimate_memory(self, precision: str, remat: str, batch: int, accum: int, sharding: str) -> dict[str, int]:
        p = get_workload(self.req.workload).param_count(self._model_cfg())
        return {"peak_bytes": self.estimate(precision, remat, batch, accum, sharding),
                "state_bytes": int(self.state_per_param(gradients=False) * p * self.state_fraction(sharding))}

    def state_per_param(self, gradients: bool = True) -> int:
        """The request's state bytes a parameter (`state_bytes_per_param` at its mu_dtype)."""
        return state_bytes_per_param(self.req.mu_dtype, gradients)

    def state_fraction(self, sharding: str) -> float:
        """The share of the state one GPU holds under `sharding` (routed experts split by an expert axis)."""
        w, cfg = get_workload(self.req.workload), self._model_cfg()
        return parse_layout(sharding).state_fraction(self.req.gpus, w.routed_expert_params(cfg) / w.param_count(cfg))

    def _model_cfg(self) -> Any:
        return get_workload(self.req.workload).config(self.req.preset, self.model)

    def estimate(self, precision: str, remat: str, batch: int, accum: int = 1, sharding: str = "replicated") -> int:
        """Parameters, gradients and AdamW state (16 bytes per parameter, 14 with a bfloat16 first moment, a 1/gpus share
        of them under FSDP), a gradient accumulator when accumulating, and activations by
        precision and remat policy."""
        w = get_workload(self.req.workload)
        cfg = self._model_cfg()
        p = w.param_count(cfg)
        state = (self.state_per_param() * p + (4 * p if accum > 1 else 0)) * self.state_fraction(sharding)
        prof = w.activation_profile(cfg)
        elem = 4 if precision == "fp32" else 2
        on_device = (() if remat.startswith("offload") else
                     tuple(n for n, w in parse_custom_remat(remat).items() if w == "device")
                     if remat.startswith(CUSTOM_REMAT) else REMAT_NAMED.get(remat, ()))
        named = sum(prof.named.get(n, 0.0) for n in on_device if n != "decoder_layer_input")
        kept = {"none": prof.n_blocks * prof.per_block,
                "dots": 0.6 * prof.n_blocks * prof.per_block,
                "dots_no_batch": 0.45 * prof.n_blocks * prof.per_block,
                }.get(remat, prof.n_blocks * (prof.block_input + named) + prof.per_block)
        activations = batch * (kept * elem + prof.head_fp32 * 4)
        return int(state + activations + self.gathered_weights(precision, remat, sharding))

    def gathered_weights(self, precision: str, remat: str, sharding: str) -> float:
        """Bytes of FSDP's gathered weights per device, in the compute dtype: with remat `none` the
        backward pass reads every block's gathered copy from the forward (all of them are live, about
        14 GB for an 8B model in bf16); another policy gathers them again block by block (two blocks
        live: the one computing and the next arriving). Weights outside the blocks (embeddings, a
        head) are gathered whole. Nothing under replicated state."""
        lay = parse_layout(sharding)
        if not lay.shards_state() or lay.state_shards(self.req.gpus) == 1:
            return 0.0
        w = get_workload(self.req.workload)
        cfg = self._model_cfg()
        elem = 4 if precision == "fp32" else 2
        blocks = w.activation_profile(cfg).n_blocks
        per_block = block_params(w, cfg)
        outside = max(0, w.param_count(cfg) - blocks * per_block)
        experts = w.routed_expert_params(cfg) / w.param_count(cfg)  # split by the expert axis, not gathered over it
        return elem * ((blocks if remat == "none" else min(2, blocks)) * per_block + outside) / lay.tensor \
            * (1.0 - experts + experts / lay.expert)

    def lower_bound(self, precision: str, remat: str, batch: int, sharding: str = "replicated") -> int:
        """Bytes per device the step needs at the least: the float32 parameters and AdamW moments
        (12 bytes per parameter, 10 with a bfloat16 first moment, a share under FSDP: live whatever XLA fuses; gradients may be fed
        straight into the update, so they are not counted), and per example the activations the
        policy must keep for the backward pass: every block's input, and where a model names its
        activations, those the backward pass reads and the policy cannot recompute (MUST_KEEP).
        Nothing else (no workspace, no logits, no recompute buffer): a compile below this bound is
        impossible, so a candidate above the budget by this bound alone is never compiled."""
        w = get_workload(self.req.workload)
        cfg = self._model_cfg()
        prof = w.activation_profile(cfg)
        elem = 4 if precision == "fp32" else 2
        offloaded_input = remat.startswith(CUSTOM_REMAT) and parse_custom_remat(remat).get(
            "decoder_layer_input") == "offload"
        if prof.named:  # a decoder's blocks are all alike: each keeps at least its input (unless offloaded)
            per_block = (0 if offloaded_input else prof.block_input) + sum(prof.named.get(n, 0.0) for n in MUST_KEEP.get(remat, ()))
            activations = prof.n_blocks * per_block
        else:  # blocks of different sizes: only one block's input is certain
            activations = 0 if offloaded_input else prof.block_input
        return int(self.state_per_param(gradients=False) * w.param_count(cfg) * self.state_fraction(sharding)
                   + batch * activations * elem)
