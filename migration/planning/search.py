"""The planner's pure arithmetic: batch candidates, the bracketed search for the largest batch
that fits, the step-time model that ranks fitting choices, and the guide's rule-of-thumb batch.

Nothing here imports JAX; every function is tested on its own. `migration/planning/planner.py` feeds these
memory figures from `migration/planning/memory.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from migration.config.layouts import parse_layout

MiB = 2**20
# Most memory kept (least recompute) first: the order in which policies are searched. A policy
# never needs more memory than the one before it, so each search starts where the last one fit.
REMAT_ORDER = ("none", "dots", "dots_no_batch", "save_dot_except_mlp", "save_qkv", "offload_dot_except_mlp", "full")

# What each policy recomputes in the backward pass: the forward work of a block's parts (a
# workload's `forward_flops_by_part`; "block" is the whole block, for models that name no parts),
# plus the elementwise work (norms, activations, residuals), counted as a fixed share of the step:
# it is memory-bound and small next to the matrix products.
ELEMENTWISE_SHARE = 0.05
RECOMPUTES: dict[str, tuple[str, ...]] = {
    "none": (),
    "dots": ("elementwise",),
    "dots_no_batch": ("elementwise", "attention"),
    "save_dot_except_mlp": ("elementwise", "mlp"),
    "save_qkv": ("elementwise", "attention", "attention_proj", "mlp"),
    "offload_dot_except_mlp": ("elementwise", "mlp"),
    "full": ("block",),
}
RECOMPUTE_NOTE = {
    "none": "no recompute",
    "dots": "recomputes elementwise work only",
    "dots_no_batch": "recomputes elementwise work and the attention-score matmuls",
    "save_dot_except_mlp": "recomputes the MLP's matmuls and elementwise work; the attention side is kept",
    "save_qkv": "keeps the q, k, v projections; recomputes attention, its projection and the MLP",
    "offload_dot_except_mlp": "recomputes the MLP; the attention side's outputs wait in host memory (PCIe copies)",
    "full": "recomputes each block's forward pass and its elementwise work",
}


def recompute_factors(forward_by_part: dict[str, float], step_flops: float, *, fused_attention: bool = False,
                      convolutional: bool = False) -> dict[str, float]:
    """Compute of a training step under each policy relative to no remat: 1 + the recomputed
    forward FLOPs (per example, by part) over the step's FLOPs (forward + backward, per example),
    + the elementwise share where the policy recomputes elementwise work.

    Corrections by the model's kind of work: cuDNN's fused attention is a custom call, not a dot,
    and its backward needs the forward's softmax statistics, which only `none` keeps: every other
    policy re-runs the attention forward (three fused-attention calls in the compiled program for
    two). JAX's dot policies save dot_general outputs, never convolutions: for a convolutional model
    `dots` and `dots_no_batch` recompute the whole block."""
    block = sum(forward_by_part.values())
    out = {}
    for name, parts in RECOMPUTES.items():
        parts = set(parts)
        if fused_attention and name != "none":
            parts.add("attention")
        if convolutional and name in ("dots", "dots_no_batch"):
            parts = {"block"}
        if "block" in parts:
            parts = {"block", "elementwise"}
        extra = sum(block if p == "block" else forward_by_part.get(p, 0.0) for p in parts if p != "elementwise")
        out[name] = 1.0 + extra / step_flops + (ELEMENTWISE_SHARE if "elementwise" in parts else 0.0)
    return out


# For a model whose block is all its forward work (a third of a step): full remat adds a third.
RECOMPUTE_FACTOR = recompute_factors({"block": 1.0}, 3.0)
# A micro-batch fills a GPU once its matrix products have this many rows per SM (one 128-row tile
# per SM); below that it runs at rows / (128 x SMs) of the peak: the stated small-batch penalty.
ROWS_PER_SM_TO_FILL = 128


def exact_candidates(candidates: list[int], global_batch: int, gpus: int) -> list[int] | None:
    """The candidates that keep the global batch exactly (batch x gpus divides it), when they form
    a chain with no gap wider than 2x up to the largest candidate; else None. Searching these
    first costs fewer compiles and gives an exact plan that loses at most half the largest fit."""
    exact = [c for c in candidates if global_batch % (c * gpus) == 0]
    if not exact or exact[-1] != candidates[-1] or any(b > 2 * a for a, b in zip(exact, exact[1:])):
        return None
    return exact


def batch_candidates(limit: int, granularity: str) -> list[int]:
    """Allowed per-device batches up to `limit`, ascending.

    multiple8: 1, 2, 4, then multiples of 8; pow2: powers of two. `limit` itself is always a
    candidate, so the batch that keeps the global batch without accumulation can be chosen.
    """
    small = [b for b in (1, 2, 4) if b <= limit]
    if granularity == "pow2":
        out = [2**k for k in range(int(math.log2(limit)) + 1)] if limit >= 1 else []
    else:
        out = small + list(range(8, limit + 1, 8))
    return sorted(set(out) | {limit})


def largest_fitting(
    candidates: list[int],
    measure: Callable[[int], float | None],
    budget: float,
    known_fit: int = 0,
    first_guess: int | None = None,
) -> int:
    """The largest candidate c with measure(c) <= budget (0 if none), for a measure that grows
    with c (peak bytes of a compile at batch c; None = does not fit at all).

    A bracketed search over the sorted candidates: the top first (the batch needed often fits), then
    the bottom, then, while the bracket is open, a guess interpolated between the measured ends
    (`_interpolated`). Each probe shrinks the bracket: never more probes than candidates, usually three
    or four. `known_fit`: a batch known to fit (under a policy that keeps more), not measured again;
    `first_guess` (a model's prediction of the boundary) replaces the first probe at the top.
    """
    values: dict[int, float | None] = {}

    def probe(i: int) -> bool:
        c = candidates[i]
        if c not in values:
            values[c] = measure(c)
        v = values[c]
        return v is not None and v <= budget

    n = len(candidates)
    if n == 0:
        return 0
    lo = max((i for i, c in enumerate(candidates) if c <= known_fit), default=-1)
    if lo == n - 1:
        return candidates[-1]
    hi = n
    if first_guess is not None:
        g = max((i for i, c in enumerate(candidates) if c <= first_guess), default=0)
        g = min(max(g, lo + 1), n - 1)
        if probe(g):
            lo = g
            if lo == n - 1:
                return candidates[-1]
            if probe(lo + 1):  # the guess is usually right: check the next candidate up first
                lo += 1
            else:
                return candidates[lo]
        else:
            hi = g
    if hi == n:
        if probe(n - 1):
            return candidates[-1]
        hi = n - 1
    if lo < 0:
        if not probe(0):
            return 0
        lo = 0
    while hi - lo > 1:
        guess = _interpolated(candidates, values, lo, hi, budget)
        if probe(guess):
            lo = guess
        else:
            hi = guess
    return candidates[lo]


def _interpolated(candidates: list[int], values: dict[int, float | None], lo: int, hi: int, budget: float) -> int:
    """The next probe inside the open bracket (lo, hi): where the line through the two measured ends
    meets the budget, or the midpoint when an end was not measured."""
    v_lo, v_hi = values.get(candidates[lo]), values.get(candidates[hi])
    if v_lo is None or v_hi is None or v_hi <= v_lo:
        return (lo + hi) // 2
    b_lo, b_hi = candidates[lo], candidates[hi]
    boundary = b_lo + (budget - v_lo) * (b_hi - b_lo) / (v_hi - v_lo)
    return max((i for i in range(lo + 1, hi) if candidates[i] <= boundary), default=lo + 1)


def rule_of_thumb_batch(memory_bytes: float, param_count: int) -> tuple[int, str]:
    """The guide's `adaptive_batch_size` formula: 80% of the memory limit, minus twice the model
    size (parameters + gradients), over 10% of the model size per sample, capped to 1..64, with
    the model size taken as float32 parameters in MB."""
    memory_mb = memory_bytes / MiB
    model_mb = param_count * 4 / MiB
    usable = memory_mb * 0.8 - 2 * model_mb
    per_sample = model_mb * 0.1
    raw = int(usable / per_sample) if per_sample > 0 else 64
    batch = max(1, min(raw, 64))
    return batch, (f"guide's formula: (0.8 x {memory_mb:,.0f} MB - 2 x {model_mb:,.1f} MB) / (0.1 x {model_mb:,.1f} MB)"
                   f" = {raw}, capped to 1..64 -> {batch}; it ignores sequence length, activations, precision and remat")


@dataclasses.dataclass(frozen=True)
class Communication:
    """Seconds of collectives per optimizer step for a layout (migration/config/layouts.py), from the
    bytes each device sends (ring algorithms: a share (n-1)/n of the data) over the link each
    collective crosses. Per micro-batch, since the step accumulates gradients in a sharded or
    replicated carry: replicated state all-reduces the float32 gradients (2 x 4 bytes per
    parameter); FSDP gathers the parameters in the compute dtype for the forward pass and again
    for the backward pass, and reduce-scatters the gradients in that dtype (3 x its bytes) over its
    group; hybrid sharding then all-reduces each group's gradient shard across the groups. A tensor
    split divides the bytes of the weights each GPU gathers (its activations' all-reduces are left
    to the compiled program).

    Expert parallelism (+epE) splits the routed experts' weights over the expert axis, so FSDP gathers
    each GPU's 1/E of them over its FSDP group (strided by E x T), and the other weights over the FSDP
    group times the expert axis; each MoE layer sends its token slots to their experts' GPUs and back
    (two all-to-alls in the forward pass, two in the backward, two more where remat recomputes the
    forward), a share (E-1)/E of `dispatch_bytes_per_example` per example, over the expert group.

    Links: inside a node `intra_bytes_per_s`; across nodes one ring per GPU of the group in a node,
    each over that GPU's network share (`network_bytes_per_s`); without them, every collective over
    `link_bytes_per_s` (the slowest link of the whole target)."""

    param_count: int
    devices: int
    compute_bytes: int  # bytes per element of the compute dtype
    link_bytes_per_s: float | None  # None: unknown (a CPU target): no communication term
    per_node: int = 0  # GPUs per node (0: all in one node)
    intra_bytes_per_s: float | None = None
    network_bytes_per_s: float | None = None
    expert_params: int = 0  # of param_count, the routed experts' (split by an expert axis)
    dispatch_bytes_per_example: float = 0.0  # one forward pass's dispatch and combine (workloads' hook)

    def parts(self, sharding: str, remat: str = "full") -> list[tuple[float, int, int]]:
        """(bytes per GPU per micro-batch, GPUs of the collectives' rings running at once, consecutive
        GPUs those lie in) of each ring collective."""
        if self.devices == 1:
            return []
        lay = parse_layout(sharding)
        axes = lay.axes(self.devices)
        t, e, fsdp, data = lay.tensor, lay.expert, axes["fsdp"], axes["data"]
        experts = self.expert_params if e > 1 else 0
        others = (self.param_count - experts) / t  # per GPU after the tensor split
        mine = experts / (t * e)  # this GPU's routed experts
        share = lambda n: (n - 1) / n
        transfers = 2 if remat == "none" else 3
        group = fsdp * lay.inner  # the GPUs sharing one copy of the state
        out = []
        if lay.shards_state():
            if fsdp * e > 1 and others:
                out.append((transfers * share(fsdp * e) * others * self.compute_bytes, group, group))
            if fsdp > 1 and mine:
                out.append((transfers * share(fsdp) * mine * self.compute_bytes, group, group))
            if data > 1:  # each group's gradient shard, all-reduced across the groups
                local = (others + mine * e) / (fsdp * e)
                out.append((2 * share(data) * local * self.compute_bytes, data, self.devices))
        else:
            if data * e > 1 and others:
                out.append((2 * share(data * e) * others * 4, self.devices, self.devices))
            if data > 1 and mine:
                out.append((2 * share(data) * mine * 4, data, self.devices))
        return out

    def all_to_all_bytes(self, sharding: str, remat: str = "full", batch: int = 1) -> float:
        """Bytes a GPU sends per micro-batch of `batch` examples to the other GPUs of its expert group."""
        e = parse_layout(sharding).expert
        if e == 1 or not self.dispatch_bytes_per_example:
            return 0.0
        return (2 if remat == "none" else 3) * (e - 1) / e * self.dispatch_bytes_per_example * batch

    def all_to_all_seconds(self, sharding: str, remat: str = "full", batch: int = 1) -> float:
        """The dispatch and combine over the expert group: inside a node at the node's link; across n nodes
        the share (n-1)/n of each GPU's bytes that leaves its node over its own network share, at the same
        time as the rest inside the node."""
        moved = self.all_to_all_bytes(sharding, remat, batch)
        if not moved or not self.link_bytes_per_s:
            return 0.0
        lay = parse_layout(sharding)
        per_node = self.per_node or self.devices
        nodes = max(1, lay.inner // per_node) if self.devices > per_node else 1
        inside = self.intra_bytes_per_s or self.link_bytes_per_s
        if nodes == 1:
            return moved / inside
        out = (nodes - 1) / nodes
        return max(moved * (1 - out) / inside, moved * out / (self.network_bytes_per_s or self.link_bytes_per_s))

    def bytes_per_micro_batch(self, sharding: str, remat: str = "full", batch: int = 1) -> float:
        """FSDP gathers the weights again for the backward pass unless the policy keeps the forward's
        gathered copies (`none` keeps every residual): two transfers then, else three."""
        return sum(b for b, _, _ in self.parts(sharding, remat)) + self.all_to_all_bytes(sharding, remat, batch)

    def link(self, group: int, span: int) -> float | None:
        """Bytes/s per GPU of ring collectives over `group` GPUs lying in `span` consecutive GPUs (the
        whole group for FSDP's, all the GPUs for the data axis of a hybrid layout): spread over as few
        nodes as that allows."""
        per_node = self.per_node or self.devices
        if self.intra_bytes_per_s is None or self.devices <= per_node:
            return self.link_bytes_per_s
        nodes = min(group, max(1, span // per_node))
        in_node = max(1, group // nodes)
        if nodes <= 1:
            return self.intra_bytes_per_s
        return min(self.intra_bytes_per_s, (self.network_bytes_per_s or self.link_bytes_per_s or 0) * in_node) \
            if self.network_bytes_per_s else self.link_bytes_per_s

    def seconds(self, sharding: str, accumulation: int, remat: str = "full", batch: int = 1) -> float:
        if not self.link_bytes_per_s:
            return 0.0
        return accumulation * (sum(b / (self.link(g, span) or self.link_bytes_per_s)
                                   for b, g, span in self.parts(sharding, remat))
                               + self.all_to_all_seconds(sharding, remat, batch))


@dataclasses.dataclass(frozen=True)
class StepCostModel:
    """Predicted step time of a (sharding, remat, per-device batch, accumulation) choice: the longer
    of its compute and its communication (XLA's latency-hiding scheduler overlaps the two), with

        compute = accumulation x (flops_per_example x batch x recompute factor) / (peak x fill)

    and fill = min(1, batch x rows_per_example x max(1, matmul_width / 128) / fill_rows): output
    tiles of 128 x 128 against the tiles that fill every SM. `peak_flops` is the target's dense
    peak for the precision; without one (a CPU target) the cost is relative (peak = 1 FLOP/s)."""

    flops_per_example: float
    rows_per_example: int
    fill_rows: int
    peak_flops: float | None
    matmul_width: int = 128
    communication: Communication | None = None
    recompute: dict[str, float] = dataclasses.field(default_factory=lambda: dict(RECOMPUTE_FACTOR))
    # Offloading policies copy their kept activations to host memory and back: bytes per example
    # each way, over the host link (bytes/s); overlapped with compute, like the collectives.
    offload_bytes_per_example: float = 0.0
    host_link_bytes_per_s: float | None = None
    # HBM bandwidth (bytes/s, at its calibrated share) for the memory-bound work every micro-batch repeats
    # whatever its size (`micro_step_seconds`); None: not counted.
    hbm_bytes_per_s: float | None = None

    def fill(self, batch: int) -> float:
        tiles_across = max(1.0, self.matmul_width / 128)
        return min(1.0, batch * self.rows_per_example * tiles_across / max(1, self.fill_rows))

    def compute_seconds(self, remat: str, batch: int, accumulation: int, sharding: str = "replicated") -> float:
        work = self.flops_per_example * batch * self.recompute[remat]
        return accumulation * (work / ((self.peak_flops or 1.0) * self.fill(batch))
                               + self.micro_step_seconds(sharding, remat))

    def micro_step_seconds(self, sharding: str, remat: str = "full") -> float:
        """What a micro-batch costs whatever its size, so what accumulation repeats: the memory-bound
        passes over the weights (their cast to the compute dtype, FSDP's gathered copies written and
        read by the forward, the backward and a policy's recompute, the weight gradients written and
        added to the float32 accumulator). A floor: compiled programs show two to three times these bytes
        (the planner scales it by theirs)."""
        comm = self.communication
        if not (self.hbm_bytes_per_s and comm and self.peak_flops):
            return 0.0
        lay = parse_layout(sharding)
        p, e = comm.param_count, comm.compute_bytes
        experts = comm.expert_params / p if lay.expert > 1 else 0.0  # routed experts, split by the expert axis
        whole = p / lay.tensor * (1.0 - experts + experts / lay.expert)  # a GPU's weights, gathered
        local = p * lay.state_fraction(comm.devices, experts)
        gathered = whole if lay.shards_state() and lay.state_shards(comm.devices) > 1 else 0.0
        passes = 2 if remat == "none" else 3
        moved = local * (4 + e) + local * 8 + 2 * gathered * e * passes + whole * e
        return moved / self.hbm_bytes_per_s

    def offload_seconds(self, remat: str, examples: int) -> float:
        """Host copies of an offloading policy for `examples` per device: out and back in."""
        if not remat.startswith("offload") or not (self.host_link_bytes_per_s and self.peak_flops):
            return 0.0
        return 2 * examples * self.offload_bytes_per_example / self.host_link_bytes_per_s

    def comm_seconds(self, sharding: str, accumulation: int, remat: str = "full", batch: int = 1) -> float:
        return self.communication.seconds(sharding, accumulation, remat, batch) \
            if self.communication and self.peak_flops else 0.0

    def step_seconds(self, remat: str, batch: int, accumulation: int, sharding: str = "replicated") -> float:
        return max(self.compute_seconds(remat, batch, accumulation, sharding),
                   self.comm_seconds(sharding, accumulation, remat, batch),
                   self.offload_seconds(remat, batch * accumulation))

    def best_possible(self, remat: str, examples_per_device: int, sharding: str = "replicated",
                      max_batch: int | None = None) -> float:
        """A lower bound for any choice under `remat` that gives each device `examples_per_device`
        examples per step with micro-batches of at most `max_batch`: the fill of the largest
        micro-batch allowed, and the fewest micro-batches."""
        largest = min(examples_per_device, max_batch or examples_per_device)
        micro = math.ceil(examples_per_device / largest)
        compute = (self.flops_per_example * examples_per_device * self.recompute[remat]
                   / ((self.peak_flops or 1.0) * self.fill(largest))) + micro * self.micro_step_seconds(sharding, remat)
        return max(compute, self.comm_seconds(sharding, micro, remat, largest),
                   self.offload_seconds(remat, examples_per_device))


@dataclasses.dataclass(frozen=True)
class Choice:
    remat: str
    per_device_batch: int
    accumulation_steps: int
    global_batch: int
    exact: bool
    step_cost: float  # seconds when the model has a peak, else relative
    fill: float
    sharding: str = "replicated"

    def to_dict(self, model: StepCostModel) -> dict[str, Any]:
        return {"sharding": self.sharding, "remat": self.remat, "per_device_batch": self.per_device_batch,
                "accumulation_steps": self.accumulation_steps, "global_batch": self.global_batch,
                "exact": self.exact, "fill": round(self.fill, 3),
                "predicted_step_s": self.step_cost if model.peak_flops else None,
                "compute_s": model.compute_seconds(self.remat, self.per_device_batch, self.accumulation_steps,
                                                   self.sharding) if model.peak_flops else None,
                "communication_s": model.comm_seconds(self.sharding, self.accumulation_steps, self.remat,
                                                      self.per_device_batch)
                if model.peak_flops else None,
                "relative_cost": self.step_cost}


def _key(key: str | tuple[str, str]) -> tuple[str, str]:
    """A `max_batch` key: a remat name (replicated state) or (sharding, remat)."""
    return key if isinstance(key, tuple) else ("replicated", key)


def rank_choices(max_batch: dict[Any, int], candidates: list[int], global_batch: int, gpus: int,
                 model: StepCostModel, accumulation: int | None = None, max_accumulation: int = 1024) -> list[Choice]:
    """Every (remat, batch, accumulation) that the searched maxima allow and that keeps the global
    batch exactly, fastest first (ties: fewer accumulation steps, then the smaller batch, which
    leaves more memory free); then, as alternatives that change the global batch, per policy the
    allowed batch with the least time per example, its accumulation rounding the global batch up
    (marked inexact; shown after exact choices only when faster than all of them). The planner
    takes the first entry, so an exact choice always wins when there is one. `accumulation` fixes
    the number of accumulation steps (an override). Keys of `max_batch` are remat names
    (replicated state) or (sharding, remat) pairs; on equal cost replicated state comes first."""
    exact: list[Choice] = []
    for key, top in max_batch.items():
        sharding, remat = _key(key)
        for b in (c for c in candidates if c <= top):
            if global_batch % (b * gpus):
                continue
            steps = global_batch // (b * gpus)
            if steps > max_accumulation or (accumulation and steps != accumulation):
                continue
            exact.append(Choice(remat, b, steps, global_batch, True, model.step_seconds(remat, b, steps, sharding),
                                model.fill(b), sharding))
    inexact = []
    for key, top in max_batch.items():
        sharding, remat = _key(key)
        options = []
        for b in (c for c in candidates if c <= top):
            steps = accumulation or max(1, math.ceil(global_batch / (b * gpus)))
            if b * gpus * steps != global_batch and steps <= max_accumulation:
                options.append(Choice(remat, b, steps, b * gpus * steps, False,
                                      model.step_seconds(remat, b, steps, sharding), model.fill(b), sharding))
        if options:  # per policy, the least time per example, then the closest global batch
            inexact.append(min(options, key=lambda c: (float(f"{c.step_cost / c.global_batch:.9g}"),
                                                       abs(c.global_batch - global_batch))))
    if exact:  # alternatives are worth showing only where they are faster than keeping the batch
        fastest = min(c.step_cost for c in exact)
        inexact = [c for c in inexact if c.step_cost < fastest]
    return sorted(exact, key=lambda c: (c.step_cost, c.sharding != "replicated", c.accumulation_steps,
                                        c.per_device_batch)) + \
        sorted(inexact, key=lambda c: (abs(c.global_batch - global_batch), c.step_cost, c.accumulation_steps))


def describe_choice(c: Choice, global_batch: int, gpus: int) -> str:
    text = f"{c.per_device_batch} per device x {gpus} GPU(s) x {c.accumulation_steps} accumulation step(s) = {c.global_batch}"
    if c.exact:
        return text + ", the TPU global batch exactly"
    return (text + f" instead of {global_batch} ({(c.global_batch - global_batch) / global_batch:+.1%}): no allowed "
            "per-device batch divides it; scale the learning rate accordingly or choose a global batch divisible by "
            "the GPU count x 8")
