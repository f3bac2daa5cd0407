"""A team's workload registered through the `jax_migration.workloads` entry point group, the same
workload given as a `package.module:OBJECT` reference on the command line, a broken entry point, and
references refused wherever they are not allowed (plain processes, the app's forms).

The team's package is tests/fixtures/team_workloads/team_models with its
team_models-0.1.dist-info (what `pip install` would leave in site-packages); the broken one is
tests/fixtures/broken_workloads/broken_team-0.1.dist-info, naming a module that does not exist.
Putting a folder on PYTHONPATH is how each subprocess "installs" them."""

import inspect
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import workloads
from migration.config import forms
from migration.common import ConfigError
from migration.config.requests import PlanRequest, RunConfig, validate, validate_plan_request
from workloads import (
    BUILTIN,
    WORKLOADS,
    WorkloadError,
    allow_references,
    resolve_workload,
)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
TEAM = FIXTURES / "team_workloads"
BROKEN = FIXTURES / "broken_workloads"
TEAM_PARAMS = 8 * 16 + 16 + 16 * 2 + 2  # the fixture's tiny preset: 8 -> 16 -> 2, with biases


def env_with(*folders: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*(str(f) for f in folders), str(ROOT)])
    return env


def python(code: str, *folders: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env_with(*folders), capture_output=True,
                          text=True, check=False, timeout=timeout)


def cli(*args: str, folders: tuple[Path, ...] = (), timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "migration", *args], cwd=ROOT, env=env_with(*folders),
                          capture_output=True, text=True, check=False, timeout=timeout)


REGISTRY_PROBE = """
import json, workloads
from workloads import WORKLOADS, BROKEN_ENTRY_POINTS
out = {"names": list(WORKLOADS), "broken": BROKEN_ENTRY_POINTS}
if "team-mlp" in WORKLOADS:
    import jax, jax.numpy as jnp
    from flax import nnx
    from migration.config.requests import RunConfig, validate
    w = WORKLOADS["team-mlp"]
    cfg = w.config("tiny")
    model = nnx.eval_shape(lambda: w.build(cfg, dtype=jnp.float32, block_wrap=lambda f: f, rngs=nnx.Rngs(0)))
    out["built"] = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    out["analytic"] = w.param_count(cfg)
    out["type"] = type(w).__module__ + "." + type(w).__name__
    validate(RunConfig(workload="team-mlp", preset="tiny"))  # a registered name: no reference needed
print(json.dumps(out))
"""


def registry(*folders: Path) -> dict:
    proc = python(REGISTRY_PROBE, *folders)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


# -- the entry point group -------------------------------------------------------------------------

@pytest.mark.slow
def test_an_installed_team_package_is_listed_with_the_built_in_workloads():
    out = registry(TEAM)
    assert out["names"][: len(BUILTIN)] == list(BUILTIN) and "team-mlp" in out["names"]
    assert out["broken"] == {}
    assert out["type"] == "team_models.TeamMLPWorkload"
    assert out["built"] == out["analytic"] == TEAM_PARAMS


@pytest.mark.slow
def test_a_broken_entry_point_is_reported_without_breaking_the_registry():
    out = registry(TEAM, BROKEN)
    assert "team-broken" not in out["names"]
    assert set(BUILTIN) | {"team-mlp"} <= set(out["names"])  # the rest still loaded
    message = out["broken"]["team-broken"]
    assert message.startswith("ModuleNotFoundError") and "broken_team_models_missing" in message
    assert "\n" not in message
    assert out["built"] == TEAM_PARAMS

    alone = registry(BROKEN)  # without the working package too
    assert alone["names"] == list(BUILTIN) and set(alone["broken"]) == {"team-broken"}


@pytest.mark.slow
def test_cli_runs_the_registered_team_workload_in_a_worker(tmp_path):
    out = tmp_path / "run.json"
    proc = cli("run", "--workload", "team-mlp", "--steps", "3", "--warmup", "1", "--platform", "cpu", "--quiet",
               "--json", str(out), folders=(TEAM,))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(out.read_text())
    assert report["status"] == "ok"
    assert report["workload"] == "team-mlp" and report["preset"] == "tiny"
    assert report["param_count"] == TEAM_PARAMS
    assert len(report["losses"]) == 3 and all(math.isfinite(loss) for loss in report["losses"])


@pytest.mark.slow
def test_cli_runs_a_reference_without_an_entry_point(tmp_path):
    """Only the package, no dist-info: not registered, but the command line may import it by reference
    (and the worker, started with the same PYTHONPATH, imports it again)."""
    shutil.copytree(TEAM / "team_models", tmp_path / "pkgs" / "team_models")
    assert "team-mlp" not in registry(tmp_path / "pkgs")["names"]
    out = tmp_path / "run.json"
    proc = cli("run", "--workload", "team_models:WORKLOAD", "--steps", "3", "--warmup", "1", "--platform", "cpu",
               "--quiet", "--json", str(out), folders=(tmp_path / "pkgs",))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(out.read_text())
    assert report["status"] == "ok" and report["param_count"] == TEAM_PARAMS
    assert report["workload"] == "team_models:WORKLOAD"


@pytest.mark.slow
def test_cli_refuses_a_reference_that_does_not_load_in_one_line(tmp_path):
    proc = cli("run", "--workload", "no_such_team_package:WORKLOAD", "--steps", "3", "--warmup", "1",
               "--platform", "cpu", "--quiet", timeout=120)
    assert proc.returncode == 2, proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "workload" in lines[0] and "no_such_team_package" in lines[0]


# -- references where they are not allowed ---------------------------------------------------------

PLAIN_PROBE = """
import json
import workloads
from migration.common import ConfigError
from migration.config.requests import PlanRequest, RunConfig, validate, validate_plan_request
out = {}
for name in ("os:system", "workloads.transformer:LLAMA"):
    try:
        workloads.resolve_workload(name)
        out[name] = "resolved"
    except workloads.WorkloadError as exc:
        out[name] = "WorkloadError: " + str(exc)
    for what, make in (("run", lambda: validate(RunConfig(workload=name))),
                       ("plan", lambda: validate_plan_request(PlanRequest(workload=name)))):
        try:
            make()
            out[name + " " + what] = "accepted"
        except ConfigError as exc:
            out[name + " " + what] = "ConfigError " + exc.field + ": " + str(exc)
out["registered"] = list(workloads.WORKLOADS)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_plain_process_refuses_references():
    proc = python(PLAIN_PROBE)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for name in ("os:system", "workloads.transformer:LLAMA"):
        assert out[name].startswith("WorkloadError: ") and "command line only" in out[name]
        assert out[f"{name} run"].startswith("ConfigError workload: ")
        assert out[f"{name} plan"].startswith("ConfigError workload: ")
    assert out["registered"] == list(BUILTIN)


@pytest.fixture
def references(request):
    """Sets whether this process resolves references for one test, and restores the setting after it."""
    before = workloads._REFERENCES_ALLOWED[0]
    allow_references(request.param)
    yield request.param
    allow_references(before)


@pytest.mark.parametrize("references", [False], indirect=True)
@pytest.mark.parametrize("name", ["os:system", "workloads.transformer:LLAMA"])
def test_references_are_refused_unless_allowed(references, name):
    assert name not in WORKLOADS
    with pytest.raises(WorkloadError, match="command line only"):
        resolve_workload(name)
    for make in (lambda: validate(RunConfig(workload=name)), lambda: validate_plan_request(PlanRequest(workload=name))):
        with pytest.raises(ConfigError) as info:
            make()
        assert info.value.field == "workload" and "\n" not in str(info.value)
    assert name not in WORKLOADS


@pytest.mark.parametrize("references", [True], indirect=True)
def test_an_allowed_reference_must_load_and_be_a_workload(references):
    with pytest.raises(WorkloadError, match="not a workloads.base.Workload"):
        resolve_workload("os:system")
    with pytest.raises(WorkloadError, match="cannot load no_such_team_package:WORKLOAD"):
        resolve_workload("no_such_team_package:WORKLOAD")
    with pytest.raises(ConfigError) as info:
        validate(RunConfig(workload="os:getcwd"))
    assert info.value.field == "workload"
    assert not {"os:system", "os:getcwd", "no_such_team_package:WORKLOAD"} & set(WORKLOADS)


# -- the app's form ---------------------------------------------------------------------------------

FORM = dict(workload="transformer", preset="tiny", source="tpu-v5e-8", global_batch=256, per_core_batch=0,
            source_precision="bf16", target="h100-sxm", gpus=1, memory_fraction=0.8, granularity="multiple8",
            remat="auto", precision="auto", accumulation=0, accumulation_steps=0, model={})


def form_plan_request(**change):
    """`forms.plan_request` with the values of a valid form, whatever its parameters are named today."""
    values = {**FORM, **change}
    params = inspect.signature(forms.plan_request).parameters
    missing = [n for n, p in params.items() if n not in values and p.default is inspect.Parameter.empty]
    assert not missing, f"forms.plan_request has new required parameters: {missing}"
    return forms.plan_request(**{n: values[n] for n in params if n in values})


def test_the_form_accepts_a_registered_workload():
    assert form_plan_request(workload="llama").workload == "llama"


@pytest.mark.parametrize("name", ["os:system", "workloads.transformer:LLAMA", "team_models:WORKLOAD"])
@pytest.mark.parametrize("references", [False, True], indirect=True)
def test_the_form_refuses_a_reference_as_workload(references, name):
    """The app never resolves references, even in a process that allows them elsewhere."""
    with pytest.raises(ConfigError) as info:
        form_plan_request(workload=name)
    assert info.value.field == "workload" and "\n" not in str(info.value)
    assert name not in WORKLOADS


def test_editing_a_registered_workloads_file_compiles_its_plan_anew(tmp_path):
    """The planner's compile-figure cache keys on the workload's own source: the same plan twice is
    served from the cache; after an edit to the team's model file it compiles again."""
    team = tmp_path / "team"
    shutil.copytree(TEAM, team)
    env = env_with(team)
    env["MIGRATION_CACHE_DIR"] = env["MIGRATION_COMPILE_CACHE_DIR"] = str(tmp_path / "cache")  # cold: its own,
    env.pop("MIGRATION_COMPILE_STORE", None)  # and no store of figures

    def plan(name: str) -> dict:
        out = tmp_path / f"{name}.json"
        proc = subprocess.run([sys.executable, "-m", "migration", "plan", "--workload", "team-mlp", "--preset", "tiny",
                               "--target", "t4", "--global-batch", "16", "--no-tpu-compile", "--quiet",
                               "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr + proc.stdout
        return json.loads(out.read_text())

    # `compiles` counts the compiles a plan made, `cache_hits` the figures the cache served
    first, again = plan("first"), plan("again")
    assert first["compiles"] > 0 and again["compiles"] == 0 and again["cache_hits"] > 0
    model = team / "team_models" / "__init__.py"
    model.write_text(model.read_text() + "\n# an edited line\n")
    edited = plan("edited")
    assert edited["compiles"] == first["compiles"], "an edited team model was served the old model's figures"
