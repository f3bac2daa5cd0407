"""The checklist items of a mixture-of-experts migration, graded from the run's router figures, its compiled
step's matrix products and its layout (migration/grading/checklist.py's rules: a pass only from a run on the
plan's target)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from migration.config.layouts import parse_layout
from migration.grading.evidence import (CHECK_CODE, FAIL, NA, NO_CODE, NOT_CHECKED, PASS, WARN, Evidence, Grade,
                                        code_scope, device_count, elsewhere, where)
from migration.planning.search import recompute_factors

# The share of token slots a capacity-dispatch MoE run may drop for a pass: GShard and Switch report
# training at about 1% dropped with a capacity factor of 1.25 to 2 once the router has learnt to spread.
MOE_DROPPED_BOUND = 0.01
# The busiest GPU's share of the slots, over an even share, above which a dropless expert-parallel run warns: the
# plan times the ragged all-to-all and the grouped products at an even spread, so a spread past this makes the
# busiest GPU's part of the step a quarter longer than planned (more than the step model's expected error).
MOE_DEVICE_LOAD_BOUND = 1.25


def moe_model(ev: Evidence) -> tuple[Any, Grade | None]:
    """The planned mixture-of-experts model's config (the run's dimensions where it ran), or the grade of an
    item that cannot use one: n/a for another workload, not checked for a config the workload refuses."""
    if ev.plan.workload != "moe":
        return None, (NA, "not a mixture-of-experts model", "none")
    # reason: the workloads import JAX; only a mixture-of-experts plan's grading needs its config
    from workloads import WORKLOADS

    model = (ev.run.config.get("model") if ev.run is not None and ev.run.config else None) or ev.plan.model
    try:
        return WORKLOADS["moe"].config(ev.plan.preset, dict(model)), None
    except ValueError:  # the workload's ModelConfigError and WorkloadError
        return None, (NOT_CHECKED, "the planned model's config could not be read", "plan the model again")


def grade_moe_dropped(ev: Evidence) -> Grade:
    cfg, ungraded = moe_model(ev)
    if ungraded:
        return ungraded
    if cfg.dispatch == "dropless":
        return NA, "dropless dispatch: every token slot is computed (grouped products), none dropped", "none"
    if not ev.ran or ev.run.router_dropped_mean is None:
        return NOT_CHECKED, f"capacity dispatch at a factor of {cfg.capacity_factor:g}: no run measured the share of " \
                            "token slots dropped", "run the plan (the run records the router's dropped share and load)"
    r = ev.run
    measured = (f"{r.router_dropped_mean:.2%} of token slots dropped on average over the timed steps (largest "
                f"{r.router_dropped_max:.2%}; bound {MOE_DROPPED_BOUND:.0%}), the busiest expert at "
                f"{r.router_load_mean:.2f}x an even share (capacity factor {cfg.capacity_factor:g}); {where(r)}")
    if r.router_dropped_mean > MOE_DROPPED_BOUND:
        return FAIL, measured, ("raise capacity_factor (each step drops the slots past it), keep the load-balancing "
                                "loss on, or compute the experts dropless")
    if not ev.on_target(r):
        return WARN, f"{measured}; {elsewhere(ev, r)}", f"confirm on {ev.plan.target_name} with your data"
    return PASS, measured, "none"


def moe_product_ratios(cfg: Any, remat: str) -> tuple[float, float]:
    """(grouped, loop): the compiled matrix-product FLOPs over the model's FLOPs (with the policy's recompute)
    that grouped products give (dropless: the model's; capacity: the routed experts' share times the capacity
    factor, plus the one-hot dispatch and combine products), and that a loop of dense products of every routed
    slot by every expert gives (the routed share times n_experts)."""
    # reason: the workloads import JAX; only a mixture-of-experts plan's grading needs them
    from workloads import WORKLOADS

    w = WORKLOADS["moe"]
    step = w.flops_per_example(cfg)
    share = 6.0 * cfg.seq_len * w.routed_expert_params(cfg) * cfg.top_k / cfg.n_experts / step  # routed experts'
    factors = recompute_factors(w.forward_flops_by_part(cfg), step)
    recompute = factors.get(remat, factors["full"])
    grouped = 1.0
    if cfg.dispatch == "capacity":
        slots = cfg.n_experts * max(1, math.ceil(cfg.capacity_factor * cfg.seq_len * cfg.top_k / cfg.n_experts))
        one_hot = cfg.n_moe_layers * 3 * 2 * (2.0 * cfg.seq_len * slots * cfg.d_model)  # dispatch, combine; fwd+bwd
        grouped += share * (slots / (cfg.seq_len * cfg.top_k) - 1.0) + one_hot / step
    return recompute * grouped, recompute * (1.0 + share * (cfg.n_experts - 1.0))


def grade_moe_grouped_gemm(ev: Evidence) -> Grade:
    cfg, ungraded = moe_model(ev)
    if ungraded:
        return ungraded
    r = ev.run
    if not ev.ran or not r.compiled_matmul_flops or not r.model_flops_per_device_step:
        return NOT_CHECKED, "no run read its compiled step's matrix products", \
            "run the plan (the run reads the compiled step's matrix-product FLOPs against the model's)"
    grouped, loop = moe_product_ratios(cfg, r.remat)
    ratio = r.compiled_matmul_flops / r.model_flops_per_device_step
    measured = (f"the compiled step's matrix products are {ratio:.2f}x the model's FLOPs ({cfg.dispatch} dispatch, "
                f"remat {r.remat}: grouped products would give about {grouped:.2f}x, a dense loop over the "
                f"{cfg.n_experts} experts about {loop:.2f}x); {where(r)}")
    looped = loop > 1.1 * grouped and ratio >= (grouped + loop) / 2
    fix = ("use capacity dispatch, or a grouped-GEMM kernel (MaxText's megablox / Tokamax GMM on TPU, cuDNN or "
           "Transformer Engine grouped GEMMs on GPU)")
    if not ev.on_target(r):
        return WARN, f"{measured}; {elsewhere(ev, r)}" + (": this compiler made a dense loop of them" if looped else
                                                           ""), f"confirm on {ev.plan.target_name} (its compiler " \
                                                                "lowers the expert products its own way)"
    if looped:
        return FAIL, f"{measured}: the experts compiled as dense products of every slot by every expert", fix
    return PASS, measured, "none"


def grade_moe_all_to_all(ev: Evidence) -> Grade:
    if ev.plan.workload != "moe":
        return NA, "not a mixture-of-experts model", "none"
    lay = parse_layout(ev.plan.sharding)
    if lay.expert == 1:
        return NA, f"{ev.plan.sharding}: no expert parallelism, so no all-to-all (each GPU computes every expert " \
                   "its tokens need)", "none"
    domain = ev.plan.domain_gpus or ev.plan.gpus_per_node
    inside = lay.inner <= domain
    planned = (f"{ev.plan.sharding}: experts over {lay.expert} GPUs"
               + (f" ({lay.inner} with the tensor split), " if lay.tensor > 1 else ", ")
               + (f"inside a link domain of {domain}" if inside else f"wider than a link domain of {domain}: the "
                  "all-to-all crosses the network"))
    if not inside:
        return WARN, planned, f"keep E x T within {domain} GPUs (ici_expert_parallelism inside a node), or accept the " \
                              "network all-to-all the plan prices"
    if not ev.ran:
        return NOT_CHECKED, f"{planned}; no run", "run the plan"
    r = ev.run
    if parse_layout(r.sharding).expert != lay.expert or device_count(r) < lay.inner:
        return WARN, f"{planned}; the run used {r.sharding} on {device_count(r)} device(s), not the plan's expert " \
                     "split", f"run the plan's layout on {lay.inner} GPUs of one node"
    measured = f"{planned}; the run ran that expert split on {device_count(r)} devices; {where(r)}"
    spread, (cfg, _) = r.router_device_load_mean, moe_model(ev)
    if spread is not None:
        dropless = cfg is not None and cfg.dispatch == "dropless"
        measured += (f"; the busiest GPU held {spread:.2f}x an even share of the token slots (largest step "
                     f"{r.router_device_load_max:.2f}x; " + ("the plan times the exchange and the expert products at "
                                                            "an even spread)" if dropless else
                                                            "capacity dispatch: fixed-size buffers, the excess dropped)"))
        if dropless and spread > MOE_DEVICE_LOAD_BOUND:
            return WARN, measured, ("keep the load-balancing loss on (aux_loss) or DeepSeek's bias, or expect the "
                                    f"busiest GPU's exchange and expert products up to {spread:.2f}x the plan's")
    if not ev.on_target(r):
        return WARN, f"{measured}; {elsewhere(ev, r)}", f"confirm on {ev.plan.target_name}"
    return PASS, measured, "none"


def grade_moe_router(ev: Evidence) -> Grade:
    """From the user's code (codecheck/router_rules.py's sites): a pass only where the code scores every router
    it has in float32 by its own cast or dtype; this product's own MoE layer (float32 router) is no evidence."""
    if ev.plan.workload != "moe":
        return NA, "not a mixture-of-experts model", "none"
    if ev.code is None:
        return NOT_CHECKED, NO_CODE + " (the router's type is read from it)", CHECK_CODE
    sites = ev.code.routers
    places = lambda found: ", ".join(f"{s.call} {Path(s.file).name}:{s.line}" for s in found[:6]) + (  # noqa: E731
        " …" if len(found) > 6 else "")
    if not sites:
        return NOT_CHECKED, f"{code_scope(ev.code)}: no router found (no softmax, sigmoid or top-k of a router's " \
                            "logits)", "check the file that defines your MoE layer with the training script"
    half = [s for s in sites if s.dtype == "16-bit"]
    if half:
        return FAIL, f"the router scores its experts in 16 bits: {places(half)} (ROUTER001)", \
            "cast the router's logits to float32 before its softmax or top-k"
    unsaid = [s for s in sites if s.dtype != "float32"]
    if unsaid:
        return WARN, f"the code does not say which type the router scores in: {places(unsaid)} (it is the logits' " \
                     "type: bfloat16 where the layer computes in bfloat16)", \
            "cast the router's logits to float32 before its softmax (jax.nn.softmax(logits.astype(jnp.float32)))"
    return PASS, f"{code_scope(ev.code)}: every router site casts to float32 first: {places(sites)}", "none"
