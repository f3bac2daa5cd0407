"""The serving checklist, graded like the training one (grading/checklist.py, same statuses and
rules) from evidence about the user's served model: a serving plan (compiled for the target without
the device: predictions), a measured serving run (`serve-run` here, on whatever device this is), the
code check of the user's serving code, and a Hugging Face export with its load-and-match check.

- `pass` only from evidence about the user's job: a measurement on the plan's target GPU that reached
  the plan's concurrency and lengths (the memory a model of those dimensions needs there), the code
  check of the user's own serving code, or the user's own weights (a checkpoint) matching. What this
  product's own server does (its compiles, its host copies) never passes an item.
- `warn` for predictions, measurements elsewhere (the CPU backend, another GPU) and random weights;
  the action says what would confirm it. `fail` where the evidence shows the item is not met.
  `not checked` without evidence; `n/a` where the item does not apply (fp32 needs no fp32 check).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from migration.codecheck import CodeCheck
from migration.common import fmt_bytes
from migration.grading.checklist import FAIL, NA, NOT_CHECKED, PASS, WARN, ChecklistItem, Grade, ItemSpec, grade_items
from migration.hardware import GPU_SPECS, gpu_spec_for_device_kind

RUN_HERE = "python -m migration serve-run"
RECOMPILE_RULES = ("SHAPE001", "TRACE001")  # code check rules whose findings recompile a step


@dataclasses.dataclass(frozen=True)
class ServingEvidence:
    """`plan`: serve_plan's result; `run`: serve_run's; `export`: export_hf's summary with its
    `verified` check (loaded with transformers, logits against this product's forward) when made."""

    plan: dict[str, Any] | None = None
    run: dict[str, Any] | None = None
    code: CodeCheck | None = None
    export: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.code is not None and self.code.role == "training":  # a training script says nothing of a server
            object.__setattr__(self, "code", None)

    @property
    def target(self) -> str:
        return self.plan["target"] if self.plan else "the target GPU"

    def run_on_target(self) -> bool:
        """Whether the run was measured on the plan's target GPU (a run without a plan: on a GPU)."""
        if not self.run or self.run["backend"] != "gpu":
            return False
        spec = gpu_spec_for_device_kind(self.run["device_kind"])
        return spec is not None and (self.plan is None or GPU_SPECS[self.plan["request"]["target"]] == spec)

    def where(self) -> str:
        r = self.run or {}
        backend = "the CPU backend" if r.get("backend") == "cpu" else f"the {r.get('backend')} backend"
        return f"measured on {r.get('device_kind')} ({backend})"


def _rows_text(rows: list[dict[str, Any]], key: str) -> str:
    return ", ".join(f"batch {r['batch']}: {r[key]}" for r in rows[:6])


def _plan_demand(plan: dict[str, Any]) -> tuple[int, int, int]:
    """The running sequences a plan sizes the server for, and its longest prompt and generation."""
    mix = plan.get("mix") or [[1.0, plan["request"]["prompt_len"], plan["request"]["gen_len"]]]
    return plan["largest_batch"], max(c[1] for c in mix), max(c[2] for c in mix)


SAME_MODEL = ("workload", "preset", "model", "precision", "kv_cache")  # what a run must share with the plan


def _other_model(plan: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """How the model a run served differs from the plan's (its family, preset, dimensions, precision or
    cache): each as "field: run's value, plan's value"; [] when it is the plan's."""
    mine, planned = run["request"], plan["request"]
    return [f"{key} {mine.get(key)!r}, the plan's {planned.get(key)!r}" for key in SAME_MODEL
            if (mine.get(key) or None) != (planned.get(key) or None)]


def grade_kv_headroom(ev: ServingEvidence) -> Grade:
    plan, run = ev.plan, ev.run
    if run and ev.run_on_target():
        spec = gpu_spec_for_device_kind(run["device_kind"])
        fraction = plan["request"]["memory_fraction"] if plan else 0.9
        budget = spec.memory_bytes * fraction
        top = max(run["rows"], key=lambda r: r["batch"])
        prompt_max, gen_max = run["request"]["prompt_range"][1], run["request"]["gen_range"][1]
        text = (f"{ev.where()}: peak {fmt_bytes(top['peak_memory_bytes'])} at batch {top['batch']} "
                f"({top['peak_memory_source']}), requests up to {prompt_max:,} + {gen_max:,} tokens, against "
                f"{fmt_bytes(budget)} ({fraction:.0%} of {spec.name})")
        if top["peak_memory_bytes"] > budget:
            return FAIL, text, "serve fewer sequences or a shorter context, or int8 weights; plan with serve-plan"
        if not plan:
            return WARN, text + "; no serving plan says how many sequences the server must hold", \
                f"plan with serve-plan for {spec.name} and measure its concurrency ({RUN_HERE} --plan PLAN.json)"
        other = _other_model(plan, run)
        if other:
            return WARN, text + f"; the run served another model than the plan's ({'; '.join(other)})", \
                "measure the plan's model: the same workload, preset, dimensions, precision and KV cache"
        need, prompt, gen = _plan_demand(plan)
        short = [what for what, got, want in (("batch", top["batch"], need), ("prompt", prompt_max, prompt),
                                                ("generation", gen_max, gen)) if got < want]
        if short:
            return WARN, (text + f"; the plan's {need:,} running sequences of up to {prompt:,} + {gen:,} tokens were "
                                 f"not reached ({', '.join(short)} short)"), \
                (f"measure the plan's concurrency and lengths on {spec.name} ({RUN_HERE} --batches {need} "
                 f"--prompt-max {prompt} --gen-max {gen})")
        return PASS, text + f": the plan's {need:,} running sequences and lengths, measured", \
            "keep the concurrency; measure again when the prompts or generations grow"
    if plan:
        if not plan["largest_batch"]:
            return FAIL, (f"predicted for {plan['target']} (compiled without the device): not even one sequence "
                          f"fits in {fmt_bytes(plan['budget_bytes'])}"), \
                "int8 weights, a shorter context, or a GPU with more memory"
        on = f"{plan['gpus']} x {plan['target']}, per GPU" if plan.get("gpus", 1) > 1 else plan["target"]
        fitting = [r for r in plan["rows"] if r["fits"]]
        if not fitting:  # a plan file whose rows are only concurrencies over the edge
            return WARN, (f"predicted for {on} (compiled without the device): {plan['largest_batch']} running "
                          f"sequences, but the plan's rows ({', '.join(str(r['batch']) for r in plan['rows'])}) all "
                          f"exceed {fmt_bytes(plan['budget_bytes'])}"), "plan again with serve-plan, without --batches"
        row = max(fitting, key=lambda r: r["batch"])
        need, prompt, gen = _plan_demand(plan)
        text = (f"predicted for {on} (compiled without the device): {plan['largest_batch']} running sequences; "
                f"at {row['batch']} peak {fmt_bytes(row['predicted_peak_bytes'])} of "
                f"{fmt_bytes(row['budget_bytes'])}, KV cache {fmt_bytes(row['kv_cache_bytes'])}")
        over = [r["batch"] for r in plan["rows"] if not r["fits"]]
        if over:
            text += f"; {', '.join(map(str, over))} do not fit"
        where = f"; the run was {ev.where()}" if run else ""
        return WARN, text + where, (f"measure it on {plan['target']} ({RUN_HERE} --batches {need} --prompt-max "
                                    f"{prompt} --gen-max {gen})")
    if run:
        return WARN, f"{ev.where()}, not on a GPU planned for", "plan for the target GPU (serve-plan) and measure there"
    return NOT_CHECKED, "no serving plan or run", "plan with serve-plan, then measure with serve-run"


def _code_grade(ev: ServingEvidence, rules: tuple[str, ...], fix: str, clean: str, keep: str) -> Grade | None:
    """An item graded from the code check of the user's serving code: fail naming each finding of
    `rules`, pass when it finds none; None without checked JAX code."""
    if ev.code is None or not ev.code.jax_files:
        return None
    found = [f for f in ev.code.findings if f.rule in rules]
    scope = f"code check of {len(ev.code.files)} file(s)"
    if found:
        return FAIL, f"{scope}: " + ", ".join(f"{f.rule} {f.file}:{f.line}" for f in found[:6]), fix
    return PASS, f"{scope}: {clean}", keep


def grade_recompiles(ev: ServingEvidence) -> Grade:
    """From the code check of the user's serving code (shapes that vary between calls, Python control
    flow on traced values); a run of this product's server says how the model compiles under bucketed
    prompts, not whether the user's server recompiles."""
    checked = _code_grade(ev, RECOMPILE_RULES, "pad prompts to a few bucket lengths and keep the batch shape fixed",
                          "no shapes that vary between calls, no Python control flow on traced values",
                          "keep the buckets; a prompt longer than the largest bucket compiles once more")
    if checked:
        return checked
    run = ev.run
    if not run:
        return NOT_CHECKED, "your serving loop was not checked and no serving run was measured", \
            "check your serving script with the code check (python -m migration check serve.py)"
    per = _rows_text(run["rows"], "recompiles")
    text = (f"this product's server, {ev.where()}: {run['rows'][0]['requests']} requests (prompts "
            f"{run['request']['prompt_range'][0]}-{run['request']['prompt_range'][1]} tokens, buckets {run['buckets']}); "
            f"compiles after the warm-up: {per}; says nothing of your server's")
    return WARN, text, "check your serving script with the code check (--code serve.py)"


def grade_host_sync(ev: ServingEvidence) -> Grade:
    checked = _code_grade(ev, ("SYNC001", "TIME001"),
                          "copy only each step's tokens to the host; keep logits and cache on the device",
                          "no host reads of device values in loops beyond what they return",
                          "keep the decode loop reading only its tokens")
    if checked:
        return checked
    text = "your serving loop was not checked"
    if ev.run:
        text += (f"; this product's server copies only each step's tokens to the host (its TPOT, {ev.where()}, "
                 "includes that copy), which says nothing of yours")
    return (WARN if ev.run else NOT_CHECKED), text, \
        "check your serving script with the code check (serve-plan or serve-run --code serve.py)"


def grade_logits(ev: ServingEvidence) -> Grade:
    run = ev.run
    precision = (run or {}).get("request", {}).get("precision") or (ev.plan or {}).get("request", {}).get("precision")
    if precision == "fp32":
        return NA, "served in fp32: the reference itself", "none"
    check = (run or {}).get("logits_check")
    if not check:
        return NOT_CHECKED, f"no logits check of {precision or 'the serving precision'} against fp32", \
            f"run {RUN_HERE} --precision {precision or 'bf16'} --checkpoint YOUR_CHECKPOINT"
    text = (f"{check['precision']} logits vs fp32 on {run['weights']} weights, {check['tokens']} tokens: RMS difference "
            f"{check['rms_ratio']:.2%} of the logits' RMS (tolerance {check['tolerance']:.0%}), top token agrees at "
            f"{check['top1_agreement']:.1%}")
    if not check["within"]:
        return FAIL, text, "serve in bf16 (or fp32), or quantise with finer scales"
    if run["weights"] != "checkpoint":
        return WARN, text + "; random weights, not your model's", \
            f"rerun with your trained weights ({RUN_HERE} --checkpoint YOUR_CHECKPOINT)"
    return PASS, text, "keep the precision; recheck after retraining"


def grade_export(ev: ServingEvidence) -> Grade:
    export = ev.export
    if not export:
        return NOT_CHECKED, "no export to the Hugging Face layout", \
            "python -m migration export-hf --checkpoint YOUR_CHECKPOINT --out FOLDER"
    verified = export.get("verified")
    text = f"exported {export.get('model', 'the model')} to {export.get('out', 'a folder')}"
    if not verified:
        return WARN, text + "; not loaded back", "load it with transformers and compare logits (export-hf --verify)"
    text += (f"; loaded with transformers {verified['transformers']}: largest logit difference "
             f"{verified['max_abs_diff']:.2g} (tolerance {verified['tolerance']:.2g})")
    if not verified["within"]:
        return FAIL, text, "the layouts disagree: do not serve this export"
    if export.get("weights") != "checkpoint":
        return WARN, text + "; random weights, not your model's", "export your checkpoint and verify again"
    return PASS, text, "hand the folder to vLLM, TGI or TensorRT-LLM"


ITEMS: dict[str, ItemSpec] = {
    "kv_headroom": ItemSpec("KV cache fits with headroom at the planned batch", (PASS, WARN, FAIL, NOT_CHECKED),
                            grade_kv_headroom),
    "serve_recompiles": ItemSpec("No recompiles after warm-up while serving", (PASS, WARN, FAIL, NOT_CHECKED),
                                 grade_recompiles),
    "serve_host_sync": ItemSpec("No host sync per token beyond the token itself", (PASS, WARN, FAIL, NOT_CHECKED),
                                grade_host_sync),
    "serve_logits": ItemSpec("Serving precision's logits within tolerance of fp32", (PASS, WARN, FAIL, NA, NOT_CHECKED),
                             grade_logits),
    "export": ItemSpec("Exported weights load and match", (PASS, WARN, FAIL, NOT_CHECKED), grade_export),
}


def serving_checklist(ev: ServingEvidence) -> list[ChecklistItem]:
    return grade_items(ITEMS, ev)
