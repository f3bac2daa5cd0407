"""A mixture-of-experts model's routed experts where the compiled program cannot price them: in a serving step,
and, in a training step at capacity dispatch, the tensor-core padding of experts with few rows (`tile_padding`,
at the end).

A server's grouped kernel (vLLM's fused MoE, TensorRT-LLM's, SGLang's) reads the weights of the experts its
tokens were routed to and no others; which those are is known only when the step runs. No program compiled
ahead can say it: XLA's GPU compiler lowers `ragged_dot` as a product of every row by every expert, masked
(bytes of all experts, FLOPs of experts / top-k times the work), so the serving planner compiles the step
with the routed experts' products left out (workloads/moe.py `MoeDecoder.routed_apart`; their weights stay
among the program's arguments, held in memory) and adds them here as kernels of the work they do, timed by
the same step-time model as the compiled ones (planning/steptime.py):

- the experts a step touches: with n tokens each routed to k of E experts, an expert is missed by a token
  with probability 1 - k/E, so E (1 - (1 - k/E)^n) experts are touched in expectation (routing taken as
  even: a skewed router touches fewer, and under expert parallelism loads the busiest GPU more);
- per MoE layer two grouped products (up, with the gate when the MLP is gated; down), over the n k rows,
  reading the touched experts' weights once; the router's product (float32 weights);
- over several GPUs the experts are split whole among them where their number divides (expert
  parallelism: E / gpus a GPU), else each expert's hidden units are (tensor parallelism); the tokens are on
  every GPU (the attention is tensor-parallel), so either way each GPU computes a share of the slots and
  the routed outputs are summed over the GPUs: one all-reduce of the layer's output, folded into the
  shared experts' where the model has them (their partial sums add first).
"""

from __future__ import annotations

import math
from typing import Any

from migration.planning.hlo_cost import Kernel

EXPERT_PARALLEL, EXPERT_TENSOR_PARALLEL = "expert parallel", "tensor parallel"


def touched_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """The expected distinct experts `tokens` tokens are routed to, each to `top_k` of `n_experts` (even routing)."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** max(tokens, 0))


def expert_layout(cfg: Any, gpus: int) -> str:
    """How the routed experts split over `gpus` GPUs: whole experts (their number divides), else their hidden units."""
    return EXPERT_PARALLEL if gpus > 1 and cfg.n_experts % gpus == 0 else EXPERT_TENSOR_PARALLEL


def expert_bytes(cfg: Any, weight_itemsize: float) -> float:
    """One routed expert's weights (up, with its gate, and down), in bytes."""
    return (3 if cfg.gated else 2) * cfg.d_model * cfg.expert_width * weight_itemsize


def routed_kernels(cfg: Any, tokens: int, gpus: int, weight_itemsize: float, act_itemsize: int,
                   unit: str) -> list[Kernel]:
    """One GPU's kernels of the routed experts and their routers over every MoE layer, `tokens` tokens a step
    (see the module's docstring): FLOPs of the slots it computes, bytes of the touched experts' weights it
    reads and of its rows, and the all-reduce of the outputs where no shared experts' carries them."""
    layers, d, f, k = cfg.n_moe_layers, cfg.d_model, cfg.expert_width, cfg.top_k
    touched = touched_experts(cfg.n_experts, k, tokens) / gpus  # a GPU's share of them (whole, or a slice of each)
    up_width = (2 if cfg.gated else 1) * f
    slots = tokens * k / gpus  # rows a GPU computes (its experts' slots, or every slot at its share of the width)
    full = tokens * k  # under tensor parallelism every GPU sees every slot's row
    rows_in = (slots if expert_layout(cfg, gpus) == EXPERT_PARALLEL else full) * d * act_itemsize
    up = Kernel("routed_up", "matmul", 2.0 * slots * d * up_width * layers,
                layers * (touched * d * up_width * weight_itemsize + rows_in + slots * up_width * act_itemsize),
                unit, float(layers))
    down = Kernel("routed_down", "matmul", 2.0 * slots * f * d * layers,
                  layers * (touched * f * d * weight_itemsize + slots * f * act_itemsize + rows_in), unit, float(layers))
    router = Kernel("router", "matmul", 2.0 * tokens * d * cfg.n_experts * layers,
                    layers * (d * cfg.n_experts * 4 + tokens * d * act_itemsize), "fp32", float(layers))
    out = [up, down, router]
    if gpus > 1 and not cfg.n_shared_experts:
        out.append(Kernel("routed_sum", "all-reduce", 0.0, layers * tokens * d * act_itemsize, None, float(layers),
                          group=gpus))
    return out


def routed_workspace_bytes(cfg: Any, tokens: int, gpus: int, act_itemsize: int) -> float:
    """One GPU's dispatch buffers of one MoE layer at `tokens` tokens: its slots' rows in, hidden and out."""
    slots = tokens * cfg.top_k / gpus
    return slots * (2 * cfg.d_model + (2 if cfg.gated else 1) * cfg.expert_width) * act_itemsize


def routed_summary(cfg: Any, gpus: int, weight_itemsize: float) -> dict[str, Any]:
    """What the plan says of the routed experts: their layout and one GPU's share of their weights."""
    layout = expert_layout(cfg, gpus)
    per_gpu = cfg.n_experts // gpus if layout == EXPERT_PARALLEL else cfg.n_experts
    return {"layout": layout if gpus > 1 else "one GPU: every expert", "experts": cfg.n_experts, "top_k": cfg.top_k,
            "moe_layers": cfg.n_moe_layers, "experts_per_gpu": per_gpu,
            "expert_share_per_gpu": 1.0 if layout == EXPERT_PARALLEL or gpus == 1 else 1.0 / gpus,
            "routed_bytes_per_gpu": cfg.n_moe_layers * cfg.n_experts * expert_bytes(cfg, weight_itemsize) / gpus,
            "priced": "apart from the compiled step: touched experts' weights read once by a grouped kernel "
                      "(planning/routed_experts.py)"}


# Training at capacity dispatch on a GPU: each expert's products are a batched GEMM over its capacity rows
# (workloads/moe.py `_capacity`), which a Hopper or Blackwell tensor core computes in products of 64 rows (wgmma's
# M): fewer rows an expert are computed as 64.
TENSOR_CORE_ROWS = 64
# The passes over the experts' products a training step makes: forward, and the gradients of the rows and the
# weights; one more where the remat policy recomputes the MLP (search.RECOMPUTES).
TRAINING_PASSES = 3


def capacity_rows(cfg: Any, per_device_batch: int, expert_axis: int) -> int | None:
    """The rows each expert's products take a micro-batch on one GPU under capacity dispatch: the GPU's
    sequences x the expert axis (its experts' rows come from that many GPUs) x the capacity a sequence; None
    under dropless routing."""
    if getattr(cfg, "dispatch", "") != "capacity":
        return None
    capacity = max(1, math.ceil(cfg.capacity_factor * cfg.seq_len * cfg.top_k / cfg.n_experts))
    return per_device_batch * expert_axis * capacity


def tile_padding(cfg: Any, per_device_batch: int, expert_axis: int, tensor_axis: int, accumulation: int,
                 recomputes_mlp: bool, unit: str | None) -> Kernel | None:
    """The work a GPU's tensor cores add a step where capacity dispatch leaves each expert fewer rows than
    TENSOR_CORE_ROWS: the missing rows of every local expert's up (with its gate) and down products, in every
    pass over them, at the compiled products' unit; None where the rows fill the tile. A kernel of FLOPs only
    (no bytes, no launch): the compiled program's products already read and write the rows."""
    rows = capacity_rows(cfg, per_device_batch, expert_axis)
    if rows is None or rows >= TENSOR_CORE_ROWS:
        return None
    width = ((2 if cfg.gated else 1) + 1) * cfg.expert_width / tensor_axis
    passes = TRAINING_PASSES + (1 if recomputes_mlp else 0)
    flops = (2.0 * (TENSOR_CORE_ROWS - rows) * cfg.d_model * width * (cfg.n_experts / expert_axis)
             * cfg.n_moe_layers * passes * accumulation)
    return Kernel("expert_tile_padding", "matmul", flops, 0.0, unit, 0.0)
