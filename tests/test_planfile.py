"""Plans from outside are data: every field typed and checked, the environment rebuilt from the
plan's decisions, nothing from the file reaching a worker's configuration or a shell script."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from migration.common import ConfigError
from migration.config.requests import PlanRequest, RunConfig
from migration.planning.deployment import deployment_snippet, environment_of
from migration.service.orchestrate import config_as_planned
from migration.planning.planfile import checked_plan, read_plan
from migration.planning.planner import plan_migration

HOSTILE = "x\n$(touch {mark})\n`touch {mark}` --xla_dump_to={mark}-dump ; touch {mark} # '\"\u202e"


def _plan(**req):
    return plan_migration(PlanRequest(compile_for_tpu=False, **req), lambda *a, **k: None)


@pytest.fixture(scope="module")
def plans():
    """Real plans: one GPU, two GPUs (XLA flags), two nodes of two (launch scripts)."""
    one = _plan(workload="mlp", preset="tiny", target="a100-40gb", global_batch=64)
    two = _plan(workload="transformer", preset="tiny", target="h100-sxm", gpus=2, global_batch=32)
    nodes = _plan(workload="mlp", preset="tiny", target="h100-sxm", gpus=4, gpus_per_node=2, global_batch=64)
    for p in (one, two, nodes):
        assert p.ok, p.message
    return {"one": one, "two": two, "nodes": nodes}


def test_a_plan_round_trips_and_its_environment_is_the_planners(plans):
    for p in plans.values():
        data = json.loads(json.dumps(p.to_dict()))
        again = checked_plan(data)
        assert again.environment == p.environment == environment_of(p)
        assert (again.per_device_batch, again.accumulation_steps, again.remat, again.precision) == \
               (p.per_device_batch, p.accumulation_steps, p.remat, p.precision)
    assert "XLA_FLAGS" in plans["two"].environment and "CUDA_DEVICE_MAX_CONNECTIONS" in plans["two"].environment


def _string_paths(value, path=()):
    """Every place in a JSON value that holds a string (keys of maps too, as ("key", path))."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _string_paths(v, (*path, i))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _string_paths(v, (*path, k))


def _set(data, path, value):
    target = data
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value


@pytest.mark.parametrize("which", ["two", "nodes"])
def test_hostile_text_in_every_string_field_reaches_no_worker_and_no_script(plans, which, tmp_path):
    plan = plans[which]
    original = json.loads(json.dumps(plan.to_dict()))
    mark = tmp_path / "PWNED"
    hostile = HOSTILE.format(mark=mark)
    paths = list(_string_paths(original))
    assert len(paths) > 60  # every text of the plan: names, reasons, notes, the environment, the table
    accepted = 0
    base = RunConfig(steps=3, warmup_steps=1)
    for path in paths:
        data = copy.deepcopy(original)
        _set(data, path, hostile)
        try:
            p = checked_plan(data)
        except ConfigError:
            continue  # a choice (workload, target, precision, ...) that is not one: refused, naming it
        accepted += 1
        assert p.environment == plan.environment, path
        cfg = config_as_planned(p, base)
        assert "xla_dump" not in cfg.xla_flags and str(mark) not in json.dumps(cfg.to_dict()), path
        script = tmp_path / "deploy.sh"
        script.write_text(deployment_snippet(p, command="true"))
        for args in ([], ["sbatch"], ["kubernetes"]):
            subprocess.run(["bash", str(script), *args], capture_output=True, timeout=30, check=False,
                           env={"PATH": "/usr/bin:/bin", "COORDINATOR": "h:1", "NODE_RANK": "0"})
        assert not mark.exists(), f"a script ran the text put at {path}"
        assert not list(tmp_path.glob("PWNED*")), path
    assert accepted > 30  # the free texts are accepted (and neutralised), not merely refused


def test_the_environment_field_of_a_file_is_never_used(plans, tmp_path):
    data = plans["two"].to_dict()
    data["environment"]["XLA_FLAGS"]["value"] = f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text"
    data["environment"]["LD_PRELOAD"] = {"value": "/tmp/evil.so", "why": "x"}
    p = checked_plan(json.loads(json.dumps(data)))
    assert p.environment == plans["two"].environment
    assert "xla_dump" not in config_as_planned(p, RunConfig()).xla_flags
    assert "LD_PRELOAD" not in deployment_snippet(p)


@pytest.mark.parametrize("field, value, message", [
    ("workload", "os.system", "workload: must be one of"),
    ("target", "../../etc", "plan.target: must be local or one of"),
    ("source", "tpu-v99", "plan.source: must be one of"),
    ("precision", "fp4", "plan.precision: must be one of"),
    ("remat", "everything", "plan.remat: must be one of"),
    ("sharding", "zero3", "plan.sharding: must be replicated, fsdp or hybrid:G"),
    ("gpus", 100_000, "gpus: must be"),
    ("gpus", "2", "plan.gpus: must be int"),
    ("per_device_batch", 10**30, "plan.per_device_batch: must be int"),
    ("memory_fraction", 7.5, "memory_fraction"),
    ("global_batch", 3, "plan.global_batch: must be per_device_batch x gpus x accumulation_steps"),
    ("nodes", 9, "plan.nodes: must be GPUs over GPUs per node"),
    ("status", "pwned", "plan.status: must be one of ok, infeasible"),
    ("model", {"n_layers": 10**9}, "n_layers"),
    ("decisions", [{"decision": "x"}], "plan.decisions: must be"),
    ("ranked", [[[[[[[[[[1]]]]]]]]]], "plan.ranked: must be"),
    ("table", [{"x": "y" * 10_000}], "plan.table: must be"),
    ("step_time", {"source": "<img src=x onerror=alert(1)>", "seconds": 1.0}, "plan.step_time.source: must be one of"),
    ("step_time", {"source": "analytic", "expected_error": "±0%"}, "plan.step_time.expected_error: must be a number"),
    ("step_time", {"source": "analytic", "seconds": -1.0}, "plan.step_time.seconds: must be a number"),
    ("predicted_step_s", -5.0, "plan.predicted_step_s: must be from 0"),
])
def test_a_bad_field_is_refused_naming_it(plans, field, value, message):
    data = json.loads(json.dumps(plans["one"].to_dict()))
    data[field] = value
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checked_plan(data)


@pytest.mark.parametrize("text, message", [
    (b"[1, 2]", "plan_file: must be a JSON object"),
    (b"{\"status\": NaN}", "not JSON"),
    (b"{" * 100_000, "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b" " * (5 * 2**20), "a plan is at most"),
    (b"{}", "missing"),
])
def test_a_file_that_is_not_a_plan_is_refused_with_one_line(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        read_plan(text)
    assert "\n" not in str(info.value)


def test_the_cli_refuses_a_hostile_plan_file(plans, tmp_path):
    data = plans["one"].to_dict()
    data["target"] = "h100-sxm; rm -rf ~"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    done = subprocess.run([sys.executable, "-m", "migration", "run", "--plan", str(path), "--steps", "2"],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert done.returncode == 2 and "plan.target: must be local or one of" in done.stderr
