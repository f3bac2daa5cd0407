"""What the command line prints: a run's report, a plan, the checklist, an autotune table. Formats the
backend's results; decides nothing."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from migration.common import experts_text, fmt_bytes, fmt_seconds, mix_text, model_name
from migration.config.limits import state_bytes_per_param
from migration.figures import plan_figures, run_figures
from migration.planning.compare import headline, price_sources, shown_rows
from migration.results import memory_provenance, write_csv as write_report_csv
from migration.service.orchestrate import describe


def fmt(value: Any, spec: str, unit: str = "") -> str:
    """`value` formatted by `spec`, or n/a."""
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def print_summary(r: Any) -> None:
    """One run's report: what ran where, and its figures."""
    print(f"\n{r.workload}/{r.preset}{' (' + r.model + ')' if r.model else ''}  {r.precision}  remat={r.remat}  "
          f"batch {r.per_device_batch} x {r.devices} device(s) x {r.accumulation_steps} accum = global "
          f"{r.global_batch}  {r.sharding} state, {r.step_style} step")
    if r.backend:
        print(f"measured on: {r.device_kind} x{r.device_count} ({r.backend} backend), JAX {r.jax_version}, host {r.host}"
              + (f", process {r.process_index} of {r.process_count}" if (r.process_count or 1) > 1 else ""))
    if r.backend == "cpu":
        print("note: CPU backend. These are CPU figures; no GPU was measured.")
    rows = [("status", r.status if r.ok else f"{r.status} ({r.failure_kind})"),
            *((f.label(), f.shown()) for f in run_figures(r)),  # the page's figures, labelled by their provenance
            ("achieved TFLOP/s, measured", fmt(r.achieved_tflops, ".3g")),
            ("process peak RSS, measured on the host", fmt_bytes(r.process_peak_rss_bytes)),
            ("fp32 matmul precision", r.fp32_matmul_precision or "n/a")]
    if r.precision == "fp16":
        rows.append(("skipped steps / loss scale", f"{r.skipped_steps} / {fmt(r.final_loss_scale, 'g')}"))
    if r.checkpoint_restored:
        rows.append(("restored", r.checkpoint_restored))
    if r.checkpoint_saved:
        rows.append(("saved", f"{r.checkpoint_saved}, {r.checkpoint_saved_bytes:,} bytes"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def progress_printer(quiet: bool, steps: int) -> Callable[[dict[str, Any]], None]:
    """Prints a run's worker events as progress lines (none when `quiet`)."""

    def progress(ev: dict[str, Any]) -> None:
        if not quiet and ev["event"] in ("started", "compiled", "step"):
            print(describe("run", steps, ev), flush=True)
    return progress


def write_report(args: argparse.Namespace, report: Any) -> None:
    """The run's report to the files --json and --csv name (process 0's job, in a multi-process one)."""
    if report.process_index:  # another process of a multi-process job: the job's files are process 0's
        print(f"process {report.process_index} of {report.process_count}: process 0 writes the report files")
        return
    if args.json:
        report.to_json(args.json)
        print(f"wrote {args.json}")
    if args.csv:
        write_report_csv([report], args.csv)
        print(f"wrote {args.csv}")


def report_failure(report: Any) -> int:
    """The exit status of a run: 0 when it finished, 1 (saying why) when not."""
    if report.ok:
        return 0
    print(f"error: run {report.failure_kind}: {report.message}", file=sys.stderr)
    if report.failure_kind == "crashed" and report.stderr_tail:
        print("--- worker stderr (tail) ---\n" + report.stderr_tail[-2000:], file=sys.stderr)
    return 1


def print_checklist(items: list[Any], title: str = "migration checklist") -> None:
    """The graded checklist, one item with its evidence and action per block."""
    print(f"\n{title}:")
    for it in items:
        print(f"  [{it.status:^11}] {it.item}\n      evidence: {it.evidence}\n      action:   {it.action}")


def print_plan(plan: Any) -> None:
    """A plan: the setup, the budget, the decisions with their reasons, the search."""
    where = (f"{plan.nodes} nodes x {plan.gpus_per_node}" if plan.nodes > 1 else f"{plan.gpus}")
    print(f"\n{model_name(plan.workload, plan.preset, plan.model)}: "
          f"{plan.param_count:,} parameters")
    print(f"{plan.source_name} (global batch {plan.requested_global_batch}, {plan.source_per_core_batch} per core, "
          f"{plan.source_precision}) -> {where} x {plan.target_name}")
    if plan.source_job:
        sj = plan.source_job
        print(f"the TPU job: {sj['devices']} devices of {fmt_bytes(sj['hbm_bytes_per_device'])}, state {sj['sharding']} "
              f"({fmt_bytes(sj['state_bytes_per_device'])} per device: {sj['why']})")
    print(f"prediction: {plan.prediction_method} -- {plan.prediction_note}")
    figures = plan_figures(plan)  # the page's figures, labelled by their provenance
    if plan.status != "ok":
        for f in figures:
            print(f"  {f.label()}: {f.shown()}")
        print(f"\nNOT FEASIBLE: {plan.message}")
        return
    print(f"\nplan: {plan.sharding} state, {plan.per_device_batch} per GPU x {plan.gpus} GPU(s) x "
          f"{plan.accumulation_steps} accumulation "
          f"= global batch {plan.global_batch}{'' if plan.global_batch_exact else ' (NOT the requested ' + str(plan.requested_global_batch) + ')'}, "
          f"{plan.precision}, remat {plan.remat}")
    for f in figures:
        print(f"  {f.label()}: {f.shown()}")
    for d in plan.decisions:
        print(f"  {d.decision:<20} {d.shown():<14} {d.reason}")
    for mode, found in (plan.max_batch_by_sharding or {plan.sharding: plan.max_batch_by_remat}).items():
        print(f"largest batch per remat policy searched ({mode} state): " + ", ".join(f"{k} {v}" for k, v in found.items()))
    st = plan.state
    if st.get("state_with_gradients_bytes_per_gpu") is not None:
        per_param = state_bytes_per_param(st.get("mu_dtype", "float32"))
        print(f"state per GPU: {fmt_bytes(st['compiled_state_bytes_per_gpu'])} compiled (parameters + AdamW moments"
              f"{', the first in bfloat16' if per_param == 14 else ''}; arithmetic {per_param - 4} B/param / "
              f"{st['shared_by']} = {fmt_bytes(st['arithmetic_state_bytes_per_gpu'])}); with gradients "
              f"{fmt_bytes(st['state_with_gradients_bytes_per_gpu'])} against {per_param} B/param / {st['shared_by']} = "
              f"{fmt_bytes(st['arithmetic_bytes_per_gpu'])} ({st['difference']:+.2%})")
    print_ranked(plan)
    print(f"the TPU-style setup on this target: {plan.tpu_setup_on_target.get('summary', 'n/a')}")
    print_source_tpu(plan)
    print(f"rule of thumb (the guide): batch {plan.rule_of_thumb_batch} -- {plan.rule_of_thumb_note}")
    print(f"matmul precision: TPU {plan.matmul_precision['tpu']}; GPU {plan.matmul_precision['gpu']}")
    print("environment for the target:")
    for name, item in plan.environment.items():
        print(f"  {name}={item['value']}    # {item['why']}")
    print(f"search: {plan.compiles} compile(s) ({plan.parallel_compiles} in a compile worker beside the search), "
          f"{plan.cache_hits} cache hit(s), {plan.ruled_out_by_bound} ruled out "
          f"uncompiled by the lower bound, {plan.search_seconds:.1f} s")
    print_comparison(plan)


def print_source_tpu(plan: Any) -> None:
    """What the TPU compiler said of the TPU job: its peak and step, or that it does not fit and the setup
    assumed in its place."""
    src = plan.source_tpu_compile
    if src.get("status") == "ok":
        kernel = f", {src['attention']} attention" if src.get("attention") else ""
        print(f"on the source TPU ({src['device_kind']}{kernel}): {fmt_bytes(src['peak_bytes_per_chip'])} per device "
              f"of {fmt_bytes(src['hbm_bytes_per_device'])}; the plan uses {fmt_bytes(plan.predicted_peak_bytes)} per GPU")
        if src.get("predicted_step_s"):
            print(f"  TPU step predicted {fmt_seconds(src['predicted_step_s'])}, {src['step_method']}")
    elif src.get("status") == "does-not-fit":
        print(f"on the source TPU ({src['device_kind']}): the TPU compiler says this setup does not fit its "
              f"{fmt_bytes(src['hbm_bytes_per_device'])} per device: {src['reason']}")
        fitted = src.get("fitted")
        if fitted:
            print(f"  assumed TPU setup (the cheapest change that fits): {fitted['setup']}, {fmt_bytes(fitted['peak_bytes_per_chip'])} "
                  f"per device; TPU step predicted {fmt_seconds(fitted['predicted_step_s'])}, {fitted['step_method']}"
                  + (f"; {fitted['other']}" if fitted.get("other") else ""))
    else:
        print(f"source TPU compile: {src.get('status')}" + (f" ({src['reason']})" if src.get("reason") else ""))


def print_comparison(plan: Any) -> None:
    """The TPU job and the GPU plan side by side (the plan's last lines: what a reader sees first)."""
    c = plan.comparison
    if not c:
        return
    shown = shown_rows(c)
    keys = list(shown[0])
    widths = [max(len(keys[i]), *(len(r[k]) for r in shown)) for i, k in enumerate(keys)]
    print("\nbefore and after (predictions unless a step says measured):")
    for row in [dict(zip(keys, keys)), *shown]:
        print("  " + "  ".join(f"{row[k]:<{w}}" for k, w in zip(keys, widths)).rstrip())
    print(f"  {headline(c)}")
    for extra in (c.get("tpu_fit"), (c.get("trust") or {}).get("text"), c.get("matching_note"), c.get("note"),
                  *("price " + line for line in price_sources(c))):
        if extra:
            print(f"  {extra}")


def print_ranked(plan: Any) -> None:
    """The fitting choices, fastest first, with their predicted step time."""
    rows = plan.ranked_rows()
    if not rows:
        return
    ranking = getattr(plan, "ranking", {}) or {}
    print("ranked choices: those compiled and timed first, fastest first; then the others by the estimate that "
          "ordered them (~); those that change the global batch last")
    if ranking.get("method"):
        print(f"  ranking: {ranking['method']}; {ranking.get('timed', 0)} timed"
              + "".join(f"; {n} {why}" for why, n in (ranking.get("not_timed") or {}).items()))
    print(f"  {'layout':<14} {'remat':<22} {'batch':>6} {'accum':>6} {'global':>7} {'fill':>6} {'step':>12}  status")
    for r in rows:
        print(f"  {r['state']:<14} {r['remat']:<22} {r['per_device_batch']:>6} {r['accumulation_steps']:>6} "
              f"{r['global_batch']:>7} {r['device_fill']:>6} {r['predicted_step']:>12}  {r['status']}"
              f"{'  <- plan' if r['chosen'] else ''}")


def print_autotune(result: Any) -> None:
    """The measured candidates beside their predictions, and the verdict."""
    print(f"\nautotune of {model_name(result.workload, result.preset, getattr(result, 'model', {}))} for {result.gpus} x {result.target_name}, global batch "
          f"{result.requested_global_batch}: {result.warmup_steps} warm-up + {result.timed_steps} timed step(s) each")
    print(f"timings: {result.measured_on}")
    if result.prediction != "seconds":
        print("predicted step: the planner's relative cost (no peak FLOP/s for this device), so measured/predicted is "
              "n/a; 'vs best' compares each to the best of the measured choices")
    head = (f"  {'pred':>4} {'state':<11} {'remat':<14} {'batch':>6} {'accum':>6} {'predicted':>14} {'measured':>11} "
            f"{'meas/pred':>9} {'pred vs best':>12} {'meas vs best':>12} {'peak memory':>12} {'meas':>4}  status")
    print(head)
    for r in result.rows:
        predicted = (f"{r.predicted_step_s * 1e3:.3g} ms" if r.predicted_step_s is not None
                     else f"{r.relative_cost:.3g} rel")
        status = "ok" if r.ok else f"{r.status} ({r.failure_kind})"
        memory = fmt_bytes(r.peak_memory_bytes)
        if r.peak_memory_source and memory_provenance(r.peak_memory_source) != "measured":
            memory += "*"
        print(f"  {'#' + str(r.predicted_rank):>4} {r.sharding:<11} {r.remat:<14} {r.per_device_batch:>6} "
              f"{r.accumulation_steps:>6} {predicted:>14} {fmt(r.measured_step_ms, '.2f', ' ms'):>11} "
              f"{fmt(r.measured_over_predicted, '.3g'):>9} {fmt(r.predicted_vs_best, '.2f', 'x'):>12} "
              f"{fmt(r.measured_vs_best, '.2f', 'x'):>12} {memory:>12} "
              f"{'#' + str(r.measured_rank) if r.measured_rank else '-':>4}  {status}"
              f"{'  <- plan' if r.planned else ''}{'  <- pick' if r.predicted_rank == result.pick_rank else ''}")
    sources = {r.peak_memory_source for r in result.rows if r.peak_memory_source
               and memory_provenance(r.peak_memory_source) != "measured"}
    for source in sources:
        print(f"  * peak memory not measured: {source}")
    for s in result.skipped:
        print(f"  not measured: #{s['predicted_rank']} ({s['per_device_batch']} x{s['accumulation_steps']}, "
              f"{s['remat']}): {s['why']}")
    for r in result.rows:
        if not r.ok:
            print(f"  #{r.predicted_rank} {r.status}: {r.message}")
    print(f"verdict: {result.verdict}")
    if result.ranking_held is not None:
        print(f"ranking held: {'yes' if result.ranking_held else 'no'} (predicted order "
              f"{' '.join(f'#{n}' for n in result.predicted_order)}, measured order "
              f"{' '.join(f'#{n}' for n in result.measured_order)})")


def plan_progress(ev: dict[str, Any]) -> None:
    """The planner's events as progress lines."""
    if ev["event"] == "plan_started":
        print(f"planning by {ev['method']}: budget {fmt_bytes(ev['budget_bytes'])} per GPU", flush=True)
    elif ev["event"] == "candidate":
        fit = "-" if ev["predicted_bytes"] is None else fmt_bytes(ev["predicted_bytes"])
        if ev.get("lower_bound"):
            fit = f"at least {fit} (lower bound over the budget: not compiled)"
        print(f"  batch {ev['per_device_batch']:>5} remat {ev['remat']:<22} x{ev['accumulation_steps']} accum: "
              f"{fit}{' (cached)' if ev['cached'] else ''}  [{ev['seconds']:.1f} s]", flush=True)


def print_serve_plan(plan: dict[str, Any]) -> None:
    """The serving plan's table: one row per concurrency (GB are 10^9 bytes; times predicted from the
    programs compiled for the target)."""
    req = plan["request"]
    gpus = plan.get("gpus", 1)
    print(f"Serving {model_name(req['workload'], req['preset'], req['model'])} on {gpus} x {plan['target']} in "
          f"{req['precision']}: {mix_text(plan['mix'])} ({plan['attention']} attention)")
    print(f"Engine modelled: {plan['engine']}")
    if gpus > 1:
        print(f"Tensor-parallel over {gpus} GPUs ({plan['link']}): memory, KV cache and limit per GPU; "
              f"collectives in TTFT and TPOT")
    if plan.get("mixture_of_experts"):
        print(experts_text(plan))
    print("Predicted from programs compiled for the GPU without it (a prefill chunk of "
          f"{plan['chunk_tokens']:,} tokens, the decode step at each concurrency): not a measurement")
    print(f"{'running':>7} {'weights GB':>10} {'KV GB':>7} {'peak GB':>8} {'fits':>5} {'TTFT ms':>8} {'TPOT ms':>8} "
          f"{'limit ms':>8} {'tokens/s':>9} {'req/s':>7} {'bytes/need':>10}")
    for r in plan["rows"]:
        print(f"{r['batch']:>7} {r['weights_bytes'] / 1e9:>10.2f} {r['kv_cache_bytes'] / 1e9:>7.2f} "
              f"{r['predicted_peak_bytes'] / 1e9:>8.2f} {'yes' if r['fits'] else 'no':>5} "
              f"{r['predicted_ttft_s'] * 1e3:>8.1f} {r['predicted_tpot_s'] * 1e3:>8.2f} "
              f"{r['bandwidth_limit_tpot_s'] * 1e3:>8.2f} {r['tokens_per_s_per_gpu'] * gpus:>9,.0f} "
              f"{r['requests_per_s']:>7.2f} {r['decode_bytes_over_needed']:>10.2f}")
    largest, budget = plan["largest_batch"], plan["budget_bytes"] / 1e9
    limits = plan["concurrency_limits"]
    if not largest:
        fewest = plan.get("fewest_gpus_for_weights", 0)
        print(f"nothing fits in {budget:.1f} GB, not even one sequence; the weights alone need at least {fewest} "
              f"GPUs of this kind{' (more than one node of 8: not planned here)' if fewest > 8 else ''}")
    else:
        bound = {"kv_cache": "the KV cache's pages", "token_budget": f"the {req['chunk']:,}-token step budget",
                 "search_limit": "the planner's limit"}.get(plan["bound_by"], plan["bound_by"])
        print(f"concurrency: {largest:,} running sequences in {budget:.1f} GB{' per GPU' if gpus > 1 else ''}, "
              f"bound by {bound} (KV cache: {limits['kv_cache']:,}; step budget: {limits['token_budget']:,}); "
              f"{plan['tokens_held_per_sequence']:,.0f} tokens a sequence at full length")
    print("TTFT: a prompt's chunks in the budget the decode tokens leave, no queue; TPOT: one engine step (the "
          "decode of every running sequence and its share of prefill); limit: the weights read and the cache read "
          "once, which no decode step beats; bytes/need: what the compiled decode step moves over that")


def print_serve_run(r: dict[str, Any]) -> None:
    req = r["request"]
    where = f"{r['backend']} backend ({r['device_kind']})"
    print(f"Served {req['requests']} requests of {model_name(req['workload'], req['preset'], req['model'])} in "
          f"{req['precision']} ({r['weights']} weights) on this machine's {where}"
          + ("; CPU figures, not a GPU's" if r["backend"] == "cpu" else ""))
    print(f"  prompts {req['prompt_range'][0]}-{req['prompt_range'][1]} tokens (buckets {r['buckets']}), generation "
          f"{req['gen_range'][0]}-{req['gen_range'][1]}; static batches, each size measured in turn")
    print(f"{'batch':>6} {'warm-up s':>9} {'compiled':>8} {'after':>5} {'TTFT p50':>9} {'p90 ms':>7} {'TPOT p50':>9} "
          f"{'p90 ms':>7} {'tokens/s':>9} {'peak GB':>8}")
    for row in r["rows"]:
        print(f"{row['batch']:>6} {row['warmup_s']:>9.1f} {row['programs_compiled']:>8} {row['recompiles']:>5} "
              f"{row['ttft_p50_s'] * 1e3:>9.1f} {row['ttft_p90_s'] * 1e3:>7.1f} {row['tpot_p50_s'] * 1e3:>9.2f} "
              f"{row['tpot_p90_s'] * 1e3:>7.2f} {row['tokens_per_s']:>9,.0f} {row['peak_memory_bytes'] / 1e9:>8.2f}")
    print(f"after: compiles after the warm-up (should be 0); peak: {r['rows'][-1]['peak_memory_source']}")
    kv = r.get("kv_cache_check")
    if kv:
        print(f"fp8 KV cache vs {kv['against']}: {kv['token_agreement']:.1%} of {kv['tokens']} generated tokens and "
              f"{kv['sequence_agreement']:.0%} of {kv['sequences']} sequences agree (greedy, same prompts)")
    check = r.get("logits_check")
    if check:
        print(f"logits in {check['precision']} vs float32 on the same {r['weights']} weights ({check['tokens']} tokens): "
              f"RMS difference {check['rms_ratio']:.2%} of the logits' RMS (tolerance {check['tolerance']:.0%}: "
              f"{'within' if check['within'] else 'OUTSIDE'}), top token agrees at {check['top1_agreement']:.1%}")


def print_export(r: dict[str, Any]) -> None:
    """What `export-hf` wrote."""
    print(f"Exported {r['model']} (step {r['step']}) from {r['checkpoint']} to {r['path']}: {r['tensors']} tensors, "
          f"{r['parameters']:,} parameters in {r['dtype']}, {r['bytes']:,} bytes")
    print(f"  files: {', '.join(r['files'])}")
    print(f"  load it: transformers.LlamaForCausalLM.from_pretrained({r['path']!r}) (no tokenizer: the tokens are "
          "the model's ids)")
    v = r.get("verified")
    if v:
        print(f"  loaded with transformers {v['transformers']} on the CPU: largest logit difference {v['max_abs_diff']:.2g}"
              f" of the largest logit (tolerance {v['tolerance']:.2g}: {'within' if v['within'] else 'OUTSIDE'}), "
              f"top token agrees at {v['top1_agreement']:.1%}")
