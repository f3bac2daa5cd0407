"""The comparison a team decides on: the TPU job and its GPU plan side by side.

For each side: memory per device against what it has (the TPU compiler's peak against the chip's HBM;
the plan's predicted peak against the budget per GPU), the step time (predicted from each side's compiled
program, or the user's measured TPU step), tokens (or examples) per second in total and per chip or GPU,
MFU, and the time and cost to train a given number of tokens at the prices of `migration.prices`. Then
how many target GPUs match the TPU job's throughput, and, where the user measured the TPU step, which step
to trust.

Everything here is arithmetic on the two predicted (or measured) step times: a labelled prediction with
the expected error of the step it comes from, never a verdict.
"""

from __future__ import annotations

import math
import re
from typing import Any

from migration.common import GiB, fmt_bytes, fmt_count, fmt_duration, fmt_percent, fmt_seconds, fmt_usd
from migration.hardware import TPU_SPECS, TpuSpec
from migration.planning import steptime
from migration.prices import gpu_price, tpu_price, tpu_price_key

_SIZE = re.compile(r"\(([0-9.]+)([KMGTP]?)\)")
_SCALE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}


def tpu_needs_bytes(reason: str) -> int | None:
    """What the TPU compiler's out-of-memory message says the program needs per chip, e.g. "the total
    memory required for HLO temporaries (1.29T) exceeds available HBM (15.75G)": the first size it names."""
    found = _SIZE.search(reason or "")
    return None if found is None else int(float(found.group(1)) * _SCALE[found.group(2)])


def tpu_fit_text(src: dict[str, Any], source: TpuSpec, per_core_batch: int) -> str:
    """What the TPU compiler's "does not fit" means for the user: their setup as described is not the one
    they run; and the setup the product assumed in its place, where one fits."""
    need = tpu_needs_bytes(src.get("reason", ""))
    needs = f"needs {fmt_bytes(need)} per device" if need else "needs more memory"
    stated = src.get("stated") or f"{per_core_batch} per core, no remat, state as the plan assumes"
    text = (f"The TPU compiler says the setup as described ({stated}) {needs}, more than the "
            f"{fmt_bytes(source.hbm_bytes_per_device)} of HBM a {source.chip.name} device has: the job you run must "
            "differ from this description.")
    fitted = src.get("fitted")
    if fitted:
        return (text + f" The TPU side below is the product's assumption in its place: {fitted['setup']} "
                f"({fmt_bytes(fitted['peak_bytes_per_chip'])} per device), the cheapest change that fits: "
                + (fitted.get("assumed") or "").removeprefix("the product's assumption: ")
                + (f" ({fitted['other']})" if fitted.get("other") else "") + ". "
                "Give the remat policy, per-core batch and sharding your job uses (or --tpu-step-s, your measured "
                "step) to compare your job itself.")
    return (text + " No setup the product tries fits either (" + "; ".join(src.get("tried") or ["none tried"])
            + "). Describe the job as it runs (per-core batch, remat policy, the TPU job's sharding) to compare "
              "like for like; the GPU plan below is for the model and global batch as given.")


def tpu_prediction(src: dict[str, Any]) -> tuple[float | None, str]:
    """The TPU step the compiled program predicts (the stated setup's, else the assumed one's where the
    stated one does not fit) and what it is of."""
    if src.get("status") == "ok":
        return src.get("predicted_step_s"), "predicted from the compiled TPU program"
    fitted = src.get("fitted") or {}
    if fitted.get("predicted_step_s"):
        return fitted["predicted_step_s"], (f"predicted from the compiled TPU program of the product's assumed setup "
                                            f"({fitted['setup']}): the stated one does not fit the chip's HBM")
    return None, f"none: the TPU compile {src.get('status', 'did not run')}"


def trust(measured_s: float | None, predicted_s: float | None, gpu_step_s: float | None,
          error: float = steptime.EXPECTED_ERROR_TPU) -> dict[str, Any] | None:
    """Which TPU step to trust where the user measured one: theirs or the compiled program's prediction, and
    what the difference says about the GPU side. None without a measurement."""
    if not measured_s:
        return None
    if not predicted_s:
        return {"use": "measured", "ratio": None, "text": (
            f"your measured TPU step ({fmt_seconds(measured_s)}) is used; there is no compiled TPU prediction to "
            "check it against")}
    ratio = measured_s / predicted_s
    pair = f"your measured {fmt_seconds(measured_s)} against the predicted {fmt_seconds(predicted_s)}"
    if 1 / (1 + error) <= ratio <= 1 + error:
        return {"use": "measured", "ratio": ratio, "agrees": True, "text": (
            f"{pair} agree within the prediction's expected error (±{error:.0%}): the description matches your "
            "job, and the GPU prediction, made the same way from the GPU's compiled program, can be read with the "
            "same confidence. Your measurement is used for the TPU side.")}
    if ratio > 1:
        adjusted = gpu_step_s * ratio if gpu_step_s else None
        return {"use": "measured", "ratio": ratio, "agrees": False, "adjusted_gpu_step_s": adjusted, "text": (
            f"{pair}: your job is {ratio:.2f}x slower than its compiled program. Trust your measurement for the TPU "
            "side (used here). What the compiled program does not see (the input pipeline, host work, "
            "checkpointing, logging) or a setup other than the one described (dimensions, per-core batch, remat) "
            "may go with the job to the GPUs" + (
                f": at the same ratio the GPU step would be about {fmt_seconds(adjusted)}" if adjusted else "")
            + ". Profile one TPU step to tell which.")}
    return {"use": "measured", "ratio": ratio, "agrees": False, "text": (
        f"{pair}: your job is {1 / ratio:.2f}x faster than the compiled program of the setup described. The "
        "description probably differs from your job (dimensions, sequence length, per-core batch, precision, a "
        "kernel the product does not model): trust your measurement for the TPU side (used here), and check the "
        "description before trusting the GPU side, which was predicted for the same description.")}


def _side(*, name: str, devices: int, chips: int, step_s: float | None, step_source: str, error: float | None,
          global_batch: int, per_example: int | None, flops_per_example: float, peak_per_chip: float | None,
          train: float, price: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """One side's figures from its step time (None: unknown, every figure derived from it n/a)."""
    per_step = global_batch * (per_example or 1)
    throughput = per_step / step_s if step_s else None
    time_s = train / throughput if throughput else None
    cost = time_s / 3600 * chips * price.usd_per_hour if time_s is not None and price is not None else None
    mfu = (flops_per_example * global_batch / (step_s * chips * peak_per_chip)
           if step_s and peak_per_chip else None)
    return {"name": name, "devices": devices, "chips": chips, "global_batch": global_batch,
            "step_s": step_s, "step_source": step_source, "expected_error": error,
            "per_step": per_step, "throughput_per_s": throughput,
            "throughput_per_chip_per_s": throughput / chips if throughput else None, "mfu": mfu,
            "time_s": time_s, "price": None if price is None else price.to_dict(), "cost_usd": cost, **extra}


def compare(plan: Any, *, train: float, prices: dict[str, float], measured_tpu_step_s: float | None,
            flops_per_example: float, tokens_per_example: int | None, gpu_peak_flops: float | None,
            local_key: str | None = None) -> dict[str, Any]:
    """The comparison of a plan (`results.Plan`, its source compile included) for `train` tokens (examples
    where the workload has no tokens) at `prices` (the user's, over the table's)."""
    source = TPU_SPECS[plan.source]
    slices = getattr(plan, "source_slices", 1) or 1
    src = plan.source_tpu_compile or {}
    unit = "tokens" if tokens_per_example else "examples"
    predicted_tpu, predicted_what = tpu_prediction(src)
    verdict = trust(measured_tpu_step_s, predicted_tpu, plan.predicted_step_s)
    tpu_step = measured_tpu_step_s or predicted_tpu
    tpu_source = "measured by you" if measured_tpu_step_s else predicted_what
    peak_chip = source.peak_flops("bf16") * source.chip.devices_per_chip
    tpu_extra = {"peak_bytes_per_device": src.get("peak_bytes_per_chip") or (src.get("fitted") or {}).get(
                     "peak_bytes_per_chip"),
                 "assumed_setup": (src.get("fitted") or {}).get("setup"),
                 "memory_bytes_per_device": source.hbm_bytes_per_device, "memory_label": "HBM per device",
                 # the user's job as stated: an assumed setup that fits is the product's, never a "fits" for theirs
                 "fits": {"ok": True, "does-not-fit": False}.get(src.get("status")),
                 "fit_source": "the TPU compiler" if src.get("status") in ("ok", "does-not-fit") else "not compiled",
                 "measured_step_s": measured_tpu_step_s, "predicted_step_s": predicted_tpu}
    tpu = _side(name=source.named(slices), devices=source.devices * slices, chips=source.chips * slices, step_s=tpu_step,
                step_source=tpu_source, error=None if measured_tpu_step_s or not predicted_tpu
                else steptime.EXPECTED_ERROR_TPU, global_batch=plan.requested_global_batch,
                per_example=tokens_per_example, flops_per_example=flops_per_example, peak_per_chip=peak_chip,
                train=train, price=tpu_price(source, prices), extra=tpu_extra)
    st = plan.step_time or {}
    ok = plan.status == "ok"
    gpu_extra = {"peak_bytes_per_device": plan.predicted_peak_bytes if ok else None,
                 "memory_bytes_per_device": plan.budget_bytes, "memory_label": "budget per GPU",
                 "fits": ok, "fit_source": "the plan's compiled peak against the budget"}
    gpu = _side(name=plan.target_name, devices=plan.gpus, chips=plan.gpus, step_s=plan.predicted_step_s if ok else None,
                step_source=({"compiled program": "predicted from the compiled GPU program"}.get(
                    st.get("source"), f"{st.get('source')} estimate") if ok and plan.predicted_step_s else
                             "none: " + ("the plan is infeasible" if not ok else "no step time for this device")),
                error=st.get("expected_error"), global_batch=plan.global_batch if ok else plan.requested_global_batch,
                per_example=tokens_per_example, flops_per_example=flops_per_example, peak_per_chip=gpu_peak_flops,
                train=train, price=gpu_price(plan.target, prices, local_key), extra=gpu_extra)
    out: dict[str, Any] = {"unit": unit, "train": train, "tpu": tpu, "gpu": gpu, "trust": verdict,
                           "tpu_fit": tpu_fit_text(src, source, plan.source_per_core_batch)
                           if src.get("status") == "does-not-fit" else None}
    out.update(matching(tpu, gpu, plan.gpus_per_node, unit))
    out["speedup"] = (tpu["time_s"] / gpu["time_s"] if tpu["time_s"] and gpu["time_s"] else None)
    out["cost_ratio"] = (gpu["cost_usd"] / tpu["cost_usd"] if tpu["cost_usd"] and gpu["cost_usd"] else None)
    out["missing_prices"] = [k for k, side in (
        (tpu_price_key(source.generation), tpu), (plan.target, gpu)) if side["price"] is None]
    out["note"] = note(tpu, gpu)
    return out


def matching(tpu: dict[str, Any], gpu: dict[str, Any], per_node: int, unit: str) -> dict[str, Any]:
    """How many target GPUs give the TPU job's throughput at the plan's throughput per GPU (weak scaling: each
    GPU keeps its batch; what more GPUs add to the collectives is not timed), and in whole nodes."""
    if not (tpu["throughput_per_s"] and gpu["throughput_per_chip_per_s"]):
        return {"matching_gpus": None, "matching_nodes": None}
    n = max(1, math.ceil(tpu["throughput_per_s"] / gpu["throughput_per_chip_per_s"] - 1e-9))
    return {"matching_gpus": n, "matching_nodes": -(-n // per_node) if n > per_node else 1,
            "matching_note": (f"{n} GPU(s) at the plan's {fmt_count(gpu['throughput_per_chip_per_s'], unit + '/s')} each "
                              f"match the TPU job's {fmt_count(tpu['throughput_per_s'], unit + '/s')}; assumes each GPU keeps that rate "
                              "at that count (the collectives of a larger job were not compiled: plan it to check)")}


def note(tpu: dict[str, Any], gpu: dict[str, Any]) -> str:
    """How to read the comparison: where each step comes from and how far off it is expected to be."""
    def err(side: dict[str, Any]) -> str:
        e = side["expected_error"]
        return side["step_source"] + (f", expected error ±{e:.0%}" if e else "")
    return (f"Predictions, not measurements, except where a step says it was measured. TPU step: {err(tpu)}; GPU "
            f"step: {err(gpu)}. Time and cost scale with the step, so they carry the same error. Prices are "
            "on-demand list prices unless you give yours.")


def rows(c: dict[str, Any]) -> list[dict[str, Any]]:
    """The comparison as table rows (metric, TPU, GPU, unit): what the CLI prints and the CSV carries."""
    unit = c["unit"]
    tpu, gpu = c["tpu"], c["gpu"]

    def both(key: str, fn: Any = None) -> tuple[Any, Any]:
        return tuple(None if s.get(key) is None else (fn(s[key]) if fn else s[key]) for s in (tpu, gpu))

    def price(s: dict[str, Any]) -> Any:
        return None if s["price"] is None else s["price"]["usd_per_hour"]

    def source(s: dict[str, Any]) -> Any:
        p = s["price"]
        return None if p is None else f"{p['source']} ({p['as_of']}{'; ' + p['note'] if p['note'] else ''})"

    out = [("hardware", tpu["name"], gpu["name"], ""),
           ("devices", tpu["devices"], gpu["devices"], "JAX devices"),
           ("chips", tpu["chips"], gpu["chips"], "chips or GPUs priced"),
           ("global batch", tpu["global_batch"], gpu["global_batch"], "examples"),
           ("peak memory per device", *both("peak_bytes_per_device", lambda b: round(b / GiB, 3)), "GiB"),
           ("memory per device", *both("memory_bytes_per_device", lambda b: round(b / GiB, 3)), "GiB (HBM / budget)"),
           ("step time", *both("step_s", lambda s: s * 1e3), "ms"),
           ("step source", tpu["step_source"], gpu["step_source"], ""),
           ("expected error", *both("expected_error"), "fraction"),
           (f"{unit}/s", *both("throughput_per_s"), f"{unit}/s"),
           (f"{unit}/s per chip", *both("throughput_per_chip_per_s"), f"{unit}/s per chip or GPU"),
           ("MFU", *both("mfu"), "fraction of the bf16 (GPU: the plan precision's) dense peak"),
           (f"time to train {fmt_count(c['train'])} {unit}", *both("time_s", lambda s: s / 86400), "days"),
           ("price", price(tpu), price(gpu), "$ per chip-hour / GPU-hour"),
           ("price source", source(tpu), source(gpu), ""),
           (f"cost to train {fmt_count(c['train'])} {unit}", *both("cost_usd"), "$"),
           ("GPUs matching the TPU job's throughput", None, c.get("matching_gpus"), "GPUs")]
    return [{"metric": m, "tpu": t, "gpu": g, "unit": u} for m, t, g, u in out]


def headline(c: dict[str, Any]) -> str:
    """The comparison in two sentences: time and cost on each side, and the GPUs that match."""
    tpu, gpu, unit = c["tpu"], c["gpu"], c["unit"]
    if gpu["time_s"] is None:
        return (f"The GPU side has no step time ({gpu['step_source']}), so no time or cost to train "
                f"{fmt_count(c['train'])} {unit} on it." + (f" On the {tpu['name']}: {fmt_duration(tpu['time_s'])}, "
                                                      f"{fmt_usd(tpu['cost_usd'])}." if tpu["time_s"] else ""))
    err = f" ±{gpu['expected_error']:.0%}" if gpu["expected_error"] else ""
    text = (f"{gpu['devices']} × {gpu['name']}: {fmt_count(c['train'])} {unit} in {fmt_duration(gpu['time_s'])} for "
            f"{fmt_usd(gpu['cost_usd'])} (predicted{err})")
    if tpu["time_s"] is None:
        return text + f"; the TPU side has no step time ({tpu['step_source']}): give your measured TPU step to compare."
    how = "measured step" if tpu["measured_step_s"] else f"predicted ±{tpu['expected_error']:.0%}"
    text += (f", against {fmt_duration(tpu['time_s'])} for {fmt_usd(tpu['cost_usd'])} on the {tpu['name']} ({how}): "
             f"{c['speedup']:.2f}x the speed")
    text += f" at {c['cost_ratio']:.2f}x the cost." if c.get("cost_ratio") else "."
    if c.get("matching_gpus"):
        nodes = f" ({c['matching_nodes']} nodes)" if (c.get("matching_nodes") or 1) > 1 else ""
        verb = "matches" if c["matching_gpus"] == 1 else "match"
        text += f" {c['matching_gpus']} × {gpu['name']}{nodes} {verb} the TPU job's {unit}/s."
    if c.get("missing_prices"):
        text += (f" No price for {', '.join(c['missing_prices'])}: give yours (e.g. --price "
                 f"{c['missing_prices'][0]}=2.5).")
    return text


def shown_rows(c: dict[str, Any]) -> list[dict[str, str]]:
    """The comparison as people read it: one row per figure, the TPU and the GPU side as text with units."""
    tpu, gpu, unit = c["tpu"], c["gpu"], c["unit"]

    def memory(s: dict[str, Any]) -> str:
        peak, have = s["peak_bytes_per_device"], s["memory_bytes_per_device"]
        fits = {True: "fits", False: "does not fit", None: "not compiled"}[s["fits"]] + (
            f" as stated; the figure is the product's assumed setup ({s['assumed_setup']}), not your job"
            if s.get("assumed_setup") else "")
        return (f"{fmt_bytes(peak)} of {fmt_bytes(have)} {s['memory_label']}: {fits}" if peak is not None else
                f"{fmt_bytes(have)} {s['memory_label']}: {fits}")

    def step(s: dict[str, Any]) -> str:
        if s["step_s"] is None:
            return s["step_source"]
        e = s["expected_error"]
        return f"{fmt_seconds(s['step_s'])}{f' ±{e:.0%}' if e else ''} ({s['step_source']})"

    def price(s: dict[str, Any]) -> str:
        p = s["price"]
        if p is None:
            return "no price: give yours"
        return f"${p['usd_per_hour']:,.2f} per {p['unit']} ({'yours' if p['source'] == 'yours' else 'list price'})"

    longest = max((s["time_s"] for s in (tpu, gpu) if s["time_s"] is not None), default=None)
    batch_unit = "sequences" if unit == "tokens" else "examples"
    rows = [("hardware", f"{tpu['name']}: {tpu['chips']} chips, {tpu['devices']} devices", f"{gpu['devices']} × {gpu['name']}"),
            ("global batch", fmt_count(tpu["global_batch"], batch_unit), fmt_count(gpu["global_batch"], batch_unit)),
            ("memory per device", memory(tpu), memory(gpu)),
            ("step time", step(tpu), step(gpu)),
            (f"{unit}/s", fmt_count(tpu["throughput_per_s"], f"{unit}/s"),
             fmt_count(gpu["throughput_per_s"], f"{unit}/s")),
            (f"{unit}/s per chip or GPU", fmt_count(tpu["throughput_per_chip_per_s"], f"{unit}/s"),
             fmt_count(gpu["throughput_per_chip_per_s"], f"{unit}/s")),
            ("MFU", fmt_percent(tpu["mfu"]), fmt_percent(gpu["mfu"])),
            (f"time to train {fmt_count(c['train'])} {unit}", fmt_duration(tpu["time_s"], like=longest),
             fmt_duration(gpu["time_s"], like=longest)),
            ("price", price(tpu), price(gpu)),
            (f"cost to train {fmt_count(c['train'])} {unit}", fmt_usd(tpu["cost_usd"]), fmt_usd(gpu["cost_usd"])),
            (f"GPUs matching the TPU job's {unit}/s", "", "n/a" if not c.get("matching_gpus") else
             f"{c['matching_gpus']} × {gpu['name']}" + (f" ({c['matching_nodes']} nodes)"
                                                       if (c.get("matching_nodes") or 1) > 1 else ""))]
    return [{"": m, "TPU (before)": t, "GPU plan (after)": g} for m, t, g in rows]


def summary(c: dict[str, Any]) -> dict[str, Any]:
    """The comparison's figures as flat columns (a history export's row of a plan)."""
    out: dict[str, Any] = {"comparison_unit": c.get("unit"), "comparison_train": c.get("train"),
                           "comparison_matching_gpus": c.get("matching_gpus")}
    for side in ("tpu", "gpu"):
        s = c.get(side) or {}
        for key in ("step_s", "step_source", "throughput_per_s", "throughput_per_chip_per_s", "mfu", "time_s",
                    "cost_usd"):
            out[f"{side}_{key}"] = s.get(key)
        out[f"{side}_usd_per_hour"] = (s.get("price") or {}).get("usd_per_hour")
    return out


def price_sources(c: dict[str, Any]) -> list[str]:
    """Where each side's price comes from, one line each."""
    out = []
    for side in (c["tpu"], c["gpu"]):
        p = side["price"]
        if p is not None:
            out.append(f"{p['key']} ${p['usd_per_hour']:,.4g} per {p['unit']}: " + (
                "your price" if p["source"] == "yours" else f"{p['note']} ({p['source']}, {p['as_of']})"))
    return out
