"""What the target's hardware allows a plan, decided before any search: the fp8 recipe where the user
allows fp8 (MXFP8 on Blackwell, per-tensor fp8 on Ada and Hopper, none elsewhere), and the attention kernel
of a model that has a choice of one (cuDNN's fused kernel where the GPU, the precision and the head size
allow it; XLA's elsewhere; the user's own choice when given). Each comes with the reason the plan shows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from migration.config.limits import FP8_PRECISIONS
from migration.config.requests import PlanRequest
from migration.planning.memory import Target
from migration.results import Decision
from workloads import get_workload
from workloads.transformer import CUDNN_HEAD_DIM_MAX


def fp8_recipe(target: Target) -> tuple[str | None, str]:
    """The fp8 precision a plan may take where the user allows fp8 (MXFP8 on Blackwell, per-tensor fp8 on
    Ada and Hopper), and why; None with the reason where the target has no fp8 units."""
    cc = target.compute_capability
    if target.platform != "gpu" or cc is None:
        return None, "allowed, but this plan is for the CPU backend, which has no fp8 units"
    if cc >= (10, 0):
        return "mxfp8", f"{target.name} (compute capability {cc[0]}.{cc[1]}) has block-scaled fp8 tensor cores"
    if cc >= (8, 9):
        return "fp8", f"{target.name} (compute capability {cc[0]}.{cc[1]}) has fp8 tensor cores (per-tensor scaling)"
    return None, f"allowed, but {target.name} (compute capability {cc[0]}.{cc[1]}) has no fp8 tensor cores"


def planned_model(req: PlanRequest, target: Target, precision: str) -> tuple[dict[str, Any], Decision | None]:
    """The model's dimension overrides as planned: the request's, plus the attention kernel for a
    model that has a choice of one (the fused cuDNN kernel on NVIDIA GPUs of compute capability 8.0+
    in bf16 or fp16: it never stores the T x T scores; plain XLA attention elsewhere)."""
    w = get_workload(req.workload)
    cfg = w.config(req.preset, req.model)
    if "attention" not in {f.name for f in dataclasses.fields(cfg)}:
        return dict(req.model), None
    head_ok = cfg.head_dim % 8 == 0 and cfg.head_dim <= CUDNN_HEAD_DIM_MAX
    fused = (target.platform == "gpu" and (target.compute_capability or (0, 0)) >= (8, 0)
             and precision in ("bf16", "fp16", *FP8_PRECISIONS) and head_ok)
    tpu_kernel = req.model.get("attention") == "splash"
    if tpu_kernel:  # the TPU code's fused kernel: its GPU counterpart is cuDNN's, where the GPU allows
        req = dataclasses.replace(req, model={k: v for k, v in req.model.items() if k != "attention"})
    if "attention" in req.model:
        value = req.model["attention"]
        why = "override: the attention your code runs"
        if value == "xla":
            why += (": XLA's implementation, which stores the T x T scores per head; the plan compiles and times "
                    "the step with it" + (" (cuDNN's fused kernel would run here: see the attention_saving "
                                          "decision)" if fused else ""))
        return dict(req.model), Decision("attention", value, why)
    if fused:
        why = (f"{target.name} runs cuDNN's fused attention (jax.nn.dot_product_attention, implementation='cudnn') "
               f"in {'bf16' if precision in FP8_PRECISIONS else precision} with head size {cfg.head_dim}: memory "
               f"linear in the sequence ({cfg.seq_len}), the "
               "scores are never stored. Planned without the GPU, the compile keeps cuDNN's call and its workspace "
               "in the peak; the kernel itself is chosen when the step first runs on the GPU")
    else:
        why = ("jax.nn.dot_product_attention with XLA's implementation, which stores the T x T scores per head: "
               "cuDNN's fused kernel needs an NVIDIA GPU of compute capability 8.0+, bf16 or fp16 compute and a head "
               f"size that is a multiple of 8 up to {CUDNN_HEAD_DIM_MAX} (here: {target.name}, {precision}, head size "
               f"{cfg.head_dim})")
    value = "cudnn" if fused else "xla"
    if tpu_kernel:
        why = "your TPU code runs Pallas' splash attention (the TPU's fused kernel); on the GPU: " + why
    return {**req.model, "attention": value}, Decision("attention", value, why)
