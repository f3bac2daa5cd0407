"""Mutation testing of the modules whose mistakes mislead a user (mutmut 3): checklist grading, the
planner's search, config and form validation, the code check's rules, history and job ownership; and the
modules that compute the figures users act on: step time and the HLO reader, memory, the planner's
capability rules, serving, deployment, a run's measures, the train step's layout, the precision and remat
policies, the fp8 recipe and the TPU side.

For each group, a copy of the working tree (tracked and untracked, not ignored) is made under
`.mutation/<group>/` with a `[tool.mutmut]` section naming the group's modules and only the tests
that cover them; `mutmut run` generates the mutants, runs those tests once to learn which test
reaches which function, then runs each mutant against the tests that reach it (forked, 2 at a
time). Printed per group: mutants, killed (a test failed or the mutant ran out of time), survived
(no test failed, or no test reaches it), listed as equivalent (`bench/mutation_equivalent.txt`:
the mutant's name and a one-line reason), the killed share of the rest per module against the goal
(85%), the group's wall time, and every survivor not listed (its name, or with --diffs its diff).
A costly fixture (tests/conftest.py `reused`) is made once per group, not once per mutant.

    bash bench/mutation.sh                    # every group
    bash bench/mutation.sh checklist config   # some
    python bench/mutation.py --list           # the groups, their modules and tests
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import record  # noqa: E402

EQUIVALENT = ROOT / "bench" / "mutation_equivalent.txt"
GOAL = 0.85
REUSE_ENV = "MIGRATION_TEST_REUSE"


@dataclass(frozen=True)
class Group:
    modules: tuple[str, ...]
    tests: tuple[str, ...]
    pytest_args: tuple[str, ...] = ()
    functions: tuple[str, ...] = ()  # mutant-name globs: only these of the modules' mutants run and count
    env: tuple[tuple[str, str], ...] = ()  # set for the group's test runs
    # "fork": each mutant's tests run in a fork of the process that ran them all once (fast); "forkserver":
    # in a fork of a process that imported nothing, for tests that run JAX (a fork of a process whose XLA
    # client has started waits for ever on its first compile: the client's threads are not copied)
    isolation: str = "fork"


GROUPS = {
    "checklist": Group(("migration/grading/checklist.py", "migration/grading/serving.py"),
                       ("tests/test_checklist*.py", "tests/test_serving_checklist.py")),
    "search": Group(("migration/planning/search.py",),
                    ("tests/test_plan_arithmetic.py", "tests/test_planner.py", "tests/test_search*.py"), ("-m", "not slow")),
    "config": Group(("migration/config/forms.py", "migration/config/limits.py", "migration/config/serving.py"),
                    ("tests/test_forms.py", "tests/test_config*.py",
                     "tests/test_fields.py", "tests/test_serving_plan.py"), ("-m", "not slow")),
    "codecheck": Group(tuple(f"migration/codecheck/{m}.py" for m in (
        "rules", "device_rules", "env_rules", "cloud_rules", "settings_rules", "shape_rules", "topology_rules",
        "sync", "timing", "monitoring")),
        ("tests/test_codecheck.py", "tests/test_codecheck_corpus.py", "tests/test_codecheck_values.py",
         "tests/test_codecheck_rules_*.py"),
        # the two slowest (23 s and 7 s) check the project's own code and the command line, not the rules
        ("--deselect", "tests/test_codecheck.py::test_the_projects_own_code_passes_its_own_check",
         "--deselect", "tests/test_codecheck.py::test_cli_check_exits_non_zero_on_errors_and_writes_json_and_csv")),
    # the modules that compute what users act on: the step-time model and the HLO reader it reads,
    # the environment a plan hands over
    # (real programs: the five stored ones of tests/test_published_ci.py; the two tests that compile one per run,
    # one of them in this process, which a forked mutant cannot, are left out)
    "steptime": Group(("migration/planning/steptime.py", "migration/planning/hlo_cost.py"),
                      ("tests/test_steptime_by_hand.py", "tests/test_hlo_cost_by_hand.py", "tests/test_steptime.py",
                       "tests/test_published_ci.py"),
                      ("-m", "not slow", "--deselect",
                       "tests/test_steptime.py::test_a_real_gpu_program_has_the_models_flops_and_its_fsdp_collectives",
                       "--deselect",
                       "tests/test_steptime.py::test_a_plan_for_a_catalog_gpu_times_its_chosen_step_from_the_compiled_program")),
    "deployment": Group(("migration/planning/deployment.py",),
                        ("tests/test_deployment_by_hand.py", "tests/test_planfile.py", "tests/test_link_domains.py",
                         "tests/test_multiprocess.py"), ("-m", "not slow")),
    # the analytic memory estimate and the lower bound that rules candidates out, a plan's peak per unit
    "memory": Group(("migration/planning/memory.py",), ("tests/test_memory_by_hand.py", "tests/test_planner_by_hand.py"),
                    functions=(*(f"migration.planning.memory.xǁMemoryPredictorǁ{f}__mutmut_*" for f in (
                        "estimate", "estimate_memory", "gathered_weights", "lower_bound", "_model_cfg")),
                               "migration.planning.memory.xǁTargetǁpeak_flops__mutmut_*")),
    # what the target's compute capability allows: fp8 recipes and refusals, cuDNN attention
    "planner": Group(("migration/planning/capability.py", "migration/config/requests.py"), ("tests/test_planner_by_hand.py",),
                     functions=("migration.planning.capability.x_fp8_recipe__mutmut_*",
                                "migration.planning.capability.x_planned_model__mutmut_*",
                                "migration.config.requests.x_check_fp8_target__mutmut_*")),
    # the serving plan's arithmetic and the engine's (not the compiles: tests/test_serving_plan.py)
    "serving": Group(("migration/planning/serving.py", "migration/planning/capacity.py"), ("tests/test_serving_by_hand.py",),
                     functions=("migration.planning.capacity.*", *(f"migration.planning.serving.x_{f}__mutmut_*" for f in (
                         "kv_cache_bytes", "serving_config", "kv_bytes_per_token", "_bytes_per_device", "_gathered_bytes",
                         "model_state", "serve_row")),
                                *(f"migration.planning.serving.xǁ_Plannerǁ{f}__mutmut_*" for f in (
                                    "__init__", "held_bytes", "peak", "long_prompt_s"))),
                     isolation="forkserver"),
    # a run's figures (MFU, throughput, memory) and a comparison side's
    "measure": Group(("migration/running/measure.py", "migration/planning/compare.py"), ("tests/test_measure_by_hand.py",),
                     functions=(*(f"migration.running.measure.x_{f}__mutmut_*" for f in (
                         "percentile", "device_memory_stats", "peak_flops_for", "_figures")),
                                "migration.planning.compare.x__side__mutmut_*"),
                     isolation="forkserver"),  # the CPU's peak is measured with JAX
    # the TPU job a plan starts from: its sharding, attention, layout, links and method line (not the libtpu
    # compile itself, nor the unchanged setup's fit on the target: both compile, tests/test_tpu_source.py)
    "source": Group(("migration/planning/source.py",), ("tests/test_source_by_hand.py",),
                    functions=tuple(f"migration.planning.source.x_{f}__mutmut_*" for f in (
                        "source_sharding", "tpu_model", "tpu_step_method", "source_layout", "tpu_links")),
                    isolation="forkserver"),
    "policies": Group(("migration/step/policies.py",), ("tests/test_policies_by_hand.py",), isolation="forkserver"),
    # the fp8 recipe (per-tensor scales, e4m3 / e5m2, the MXFP8 fallback, which layers it reaches)
    "fp8": Group(("migration/step/fp8.py",), ("tests/test_fp8_by_hand.py",), isolation="forkserver"),
    # how the step splits its state and batch (what each plan's memory assumes); the step's arithmetic itself
    # (accumulation, loss scaling) is checked by real runs in tests/test_numerics.py, too slow to run per mutant
    "train": Group(("migration/step/train.py",), ("tests/test_train_by_hand.py",),
                   functions=(*(f"migration.step.train.x_{f}__mutmut_*" for f in ("fsdp_spec", "batch_axes", "fsdp_axis",
                                                                               "make_mesh", "make_data_mesh")),
                              "migration.step.train.xǁTrainProgramǁmicro_batch__mutmut_*",
                              "migration.step.train.xǁTrainProgramǁglobal_batch__mutmut_*"),
                   isolation="forkserver"),
    "history": Group(("migration/service/history.py", "migration/service/accounts.py"),
                     ("tests/test_history*.py", "tests/test_security_and_input.py")),
    # job ownership and the queue: the service's own rules (who sees and stops a job, limits, lane
    # order, what each ending records), not the functions that start planner and run workers
    "jobs": Group(("migration/service/jobs.py", "migration/service/job.py"),
                  ("tests/test_job_ownership.py", "tests/test_fair_share.py"),
                  # a mutant that never lets a job start fails by timing out: bound each test tightly;
                  # the real code-check workers of the first fair-share test add time, not rules
                  ("--timeout=20", "--deselect",
                   "tests/test_fair_share.py::test_code_checks_of_two_users_alternate_in_their_lane"),
                  ("migration.service.job.*",
                   *(f"migration.service.jobs.xǁJobServiceǁ{f}__mutmut_*" for f in (
                       "__init__", "_submit_task", "_refuse_past_limits", "_submit", "_check_quotas", "_enqueue",
                       "_execute", "_may_start", "_wait_turn", "_leave_lane", "_change_lane", "used_today",
                       "budget_line", "_finish_unstarted", "_queue_order", "_record_end", "get", "cancel",
                       "position", "running", "jobs", "shutdown", "_forget_old"))),
                  # a job starts in milliseconds here: a mutant that never starts one fails after 3 s, not 10
                  (("MIGRATION_TEST_WAIT_S", "3"),)),
}

PRELOAD = ("numpy", "jax", "jax.numpy", "flax.nnx", "optax", "pytest", "hypothesis")
JAX_ENV = (("JAX_PLATFORMS", "cpu"), ("JAX_NUM_CPU_DEVICES", "8"), ("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1"))

STATUS = re.compile(r"^\s*(\S+): (.+)$")
MODULE = re.compile(r"^(.*?)\.x[ǁ_]")
KILLED = {"killed", "timeout", "segfault", "caught by type check"}


def equivalents() -> dict[str, str]:
    """Mutant name -> why it is equivalent (lines `name  reason`, # comments)."""
    out = {}
    if EQUIVALENT.exists():
        for line in EQUIVALENT.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                name, _, reason = line.partition(" ")
                out[name] = reason.strip()
    return out


def copy_tree(dest: Path, ref: str | None) -> None:
    """The working tree's tracked and untracked files (not the ignored ones), or commit `ref`'s."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if ref:
        archive = subprocess.run(["git", "archive", ref], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())


def toml_list(items) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


def configure(dest: Path, group: Group) -> None:
    """The group's [tool.mutmut]: its modules mutated, its tests selected, one pytest process each."""
    section = f"""

[tool.mutmut]
source_paths = ["migration"]
only_mutate = {toml_list(group.modules)}
also_copy = {toml_list(sorted(p.name for p in dest.iterdir() if p.name not in ("migration", "tests")))}
pytest_add_cli_args = {toml_list(("--numprocesses=0", "-p", "no:cacheprovider", "-q", "--durations=0", *group.pytest_args))}
pytest_add_cli_args_test_selection = {toml_list(sorted({str(p.relative_to(dest)) for t in group.tests for p in dest.glob(t)}))}
timeout_multiplier = 5.0
timeout_constant = 15.0
use_git_change_detection = false
process_isolation = "{group.isolation}"
forkserver_warmup = "import"
preload_modules_file = "mutmut_preload.txt"
"""
    with open(dest / "pyproject.toml", "a") as f:
        f.write(section)
    # the fork server imports the libraries once (importing JAX starts no XLA client: that waits for the first
    # array or compile, in each mutant's own process); JAX reads these variables when imported, as conftest sets them
    (dest / "mutmut_preload.txt").write_text("\n".join(PRELOAD) + "\n")


def mutmut(dest: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=dest, capture_output=True, text=True)


SHOW = """
import sys
from mutmut.__main__ import find_mutant, get_diff_for_mutant
for name in sys.stdin.read().split():
    print(get_diff_for_mutant(name, path=find_mutant(name).path).rstrip(), end="\\n\\n")
"""


def diffs(dest: Path, names: list[str]) -> str:
    """The mutants' diffs, in one process (`mutmut show` starts one per mutant)."""
    return subprocess.run([sys.executable, "-c", SHOW], cwd=dest, input="\n".join(names), capture_output=True,
                          text=True).stdout


def run_group(name: str, group: Group, work: Path, limit_s: float, ref: str | None, rerun: bool = True) -> dict:
    dest = work / name
    elapsed, cut = float("nan"), False
    if rerun:
        copy_tree(dest, ref)
        configure(dest, group)
        reuse = dest / "reused-fixtures"  # tests/conftest.py `reused`: the costly fixtures built once
        reuse.mkdir()
        start = time.monotonic()
        with open(dest / "run.log", "w") as log:  # mutmut's progress, as it goes
            try:
                subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(os.cpu_count() or 2),
                                *group.functions],
                               cwd=dest, stdout=log, stderr=subprocess.STDOUT, timeout=limit_s,
                               env={**os.environ, REUSE_ENV: str(reuse), **dict(JAX_ENV), **dict(group.env)})
            except subprocess.TimeoutExpired:
                cut = True
        elapsed = time.monotonic() - start
        (dest / "elapsed_s").write_text(f"{elapsed:.1f} {int(cut)}")
    elif (dest / "elapsed_s").exists():
        text, flag = (dest / "elapsed_s").read_text().split()
        elapsed, cut = float(text), flag == "1"
    statuses = {}
    for line in mutmut(dest, "results", "--all", "true").stdout.splitlines():
        m = STATUS.match(line)
        if m and (not group.functions or any(fnmatch.fnmatchcase(m.group(1), f) for f in group.functions)):
            statuses[m.group(1)] = m.group(2).strip()
    return {"group": name, "statuses": statuses, "elapsed_s": elapsed, "cut": cut, "dest": dest}


def module_of(mutant: str) -> str:
    """`migration.codecheck.sync.xǁSyncWalkǁ_test__mutmut_3` -> `migration/codecheck/sync.py`."""
    return MODULE.match(mutant).group(1).replace(".", "/") + ".py"


def score(statuses: dict[str, str], listed: dict[str, str]) -> dict:
    killed = [n for n, s in statuses.items() if s in KILLED]
    unchecked = [n for n, s in statuses.items() if s == "not checked"]
    equivalent = [n for n, s in statuses.items() if s not in KILLED and n in listed]
    survived = [n for n, s in statuses.items() if s not in KILLED and n not in listed and s != "not checked"]
    scored = len(killed) + len(survived)
    return {"mutants": len(statuses), "killed": len(killed), "survived": survived, "equivalent": len(equivalent),
            "timeouts": sum(s == "timeout" for s in statuses.values()),
            "not_checked": len(unchecked), "score": len(killed) / scored if scored else float("nan")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("groups", nargs="*", help=f"some of {', '.join(GROUPS)} (default: all)")
    parser.add_argument("--list", action="store_true", help="print the groups and exit")
    parser.add_argument("--work", default=str(ROOT / ".mutation"), help="where the copies go (default .mutation/)")
    parser.add_argument("--limit-s", type=float, default=3600, help="stop a group's run after this long")
    parser.add_argument("--ref", help="score the tests and code of this commit (default: the working tree)")
    parser.add_argument("--only", action="append", default=[], metavar="MODULE",
                        help="mutate only this module of the group (repeatable), e.g. migration/codecheck/sync.py")
    parser.add_argument("--diffs", action="store_true", help="print each survivor's diff, not only its name")
    parser.add_argument("--report-only", action="store_true", help="report the last run's results again")
    parser.add_argument("--json", metavar="PATH", help="write the table as a record (bench/results/mutation.json)")
    args = parser.parse_args(argv)
    if args.list:
        for name, g in GROUPS.items():
            only = f" (only {len(g.functions)} name patterns)" if g.functions else ""
            print(f"{name}: mutates {' '.join(g.modules)}{only}; runs {' '.join(g.tests)} {' '.join(g.pytest_args)}")
        return 0
    unknown = [g for g in args.groups if g not in GROUPS]
    if unknown:
        parser.error(f"unknown group {', '.join(unknown)}; groups are {', '.join(GROUPS)}")
    reports, listed = [], equivalents()
    for name in args.groups or list(GROUPS):
        if args.only:
            GROUPS[name] = dataclasses.replace(GROUPS[name], modules=tuple(
                m for m in GROUPS[name].modules if m in args.only) or GROUPS[name].modules)
        print(f"== {name}: {' '.join(GROUPS[name].modules)}", flush=True)
        r = run_group(name, GROUPS[name], Path(args.work), args.limit_s, args.ref, rerun=not args.report_only)
        reports.append(r)
        survived = score(r["statuses"], listed)["survived"]
        if survived:
            print(f"survived ({len(survived)}):")
            print(diffs(r["dest"], survived) if args.diffs else "\n".join(survived), flush=True)
    print(f"\n{'module':<40} {'mutants':>7} {'killed':>6} {'survived':>8} {'equivalent':>10} {'killed %':>8}  "
          f"goal {GOAL:.0%}")
    failed, rows = False, []
    for r in reports:
        by_module: dict[str, dict[str, str]] = {}
        for mutant, status in r["statuses"].items():
            by_module.setdefault(module_of(mutant), {})[mutant] = status
        for module in GROUPS[r["group"]].modules:
            m = score(by_module.get(module, {}), listed)
            ok = m["score"] >= GOAL and not m["not_checked"] and not r["cut"]
            failed |= not ok
            note = f" ({m['not_checked']} not run)" if m["not_checked"] else ""
            note += f" ({m['timeouts']} of the killed ran out of time)" if m["timeouts"] else ""
            print(f"{module:<40} {m['mutants']:>7} {m['killed']:>6} {len(m['survived']):>8} {m['equivalent']:>10} "
                  f"{m['score']:>8.1%}  {'met' if ok else 'not met'}{note}")
            rows.append([f"`{module}`", str(m["mutants"]), str(m["killed"]), str(len(m["survived"])),
                         str(m["equivalent"]), f"{m['score']:.1%}{note}"])
        cut = ", cut at the time limit" if r["cut"] else ""
        print(f"  {r['group']}: {len(r['statuses'])} mutants in {r['elapsed_s'] / 60:.1f} min{cut}")
    record.write(args.json, "mutation", [record.table(
        f"Mutants killed per module (goal {GOAL:.0%} of those not listed as equivalent)",
        ["module", "mutants", "killed", "survived", "equivalent", "killed % of the rest"], rows)],
        [f"{r['group']}: {len(r['statuses'])} mutants in {r['elapsed_s'] / 60:.1f} min" for r in reports])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
