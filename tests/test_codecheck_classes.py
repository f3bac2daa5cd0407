"""The code check on the ways real scripts say the same thing another way: waits and helpers written as
lambdas or local functions, synchronous calls, gates that compute elapsed time or call a helper,
module-level aliases, a project's own copy of a pmap-era helper, and the removed-API vocabulary generated
from JAX's and Flax's changelogs. Each case has its near miss, which must stay quiet."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from migration.codecheck import check_source
from migration.codecheck.removed_api import CHANGELOG_REMOVED
from migration.codecheck.vocabulary import REMOVED

ROOT = Path(__file__).resolve().parent.parent

STEP = """\
import time
import jax
import jax.numpy as jnp

@jax.jit
def train_step(state, batch):
    return state, {"loss": jnp.mean(batch)}
"""


def lines(src: str, rule: str) -> list[int]:
    return [f.line for f in check_source(textwrap.dedent(src)) if f.rule == rule]


def line_of(src: str, marker: str) -> int:
    return next(i for i, text in enumerate(textwrap.dedent(src).splitlines(), 1) if marker in text)


# value tracking through lambdas and local helpers ---------------------------------------------------

def test_a_wait_inside_a_lambda_the_loop_calls_is_reported_in_the_lambda():
    src = STEP + """
report = lambda m: print("loss", float(m["loss"]))  # WAIT

def train(state, data):
    for batch in data:
        state, metrics = train_step(state, batch)
        report(metrics)
    return state
"""
    assert lines(src, "SYNC001") == [line_of(src, "# WAIT")]


def test_a_lambda_that_only_counts_is_not_a_wait():
    src = STEP + """
count = lambda m: len(m)

def train(state, data):
    for batch in data:
        state, metrics = train_step(state, batch)
        count(metrics)
    return state
"""
    assert lines(src, "SYNC001") == []


def test_a_wait_in_a_nested_helper_is_reported_where_it_waits():
    src = STEP + """
def train(state, data):
    def log_now(metrics):
        jax.device_get(metrics)  # WAIT
    for batch in data:
        state, metrics = train_step(state, batch)
        log_now(metrics)
    return state
"""
    assert lines(src, "SYNC001") == [line_of(src, "# WAIT")]


# gates recognised by what they compute ---------------------------------------------------------------

@pytest.mark.parametrize("gate", [
    "time.time() - last > 60",
    "now - last >= 60.0",
    "should_log(step)",
    "summaries.write_every_n_steps(writer, step, loss)",
    "step % 100 == 0 and is_main",
    "(step + 1) % 100 == 0 or step == 0",
])
def test_a_fetch_under_a_gate_that_holds_on_few_steps_is_not_reported(gate):
    src = STEP + f"""
def should_log(step):
    return step % 100 == 0

def train(state, data, is_main, summaries, writer):
    last = time.time()
    for step, batch in enumerate(data):
        now = time.time()
        state, metrics = train_step(state, batch)
        loss = metrics["loss"]
        if {gate}:
            last = now
            print(float(loss))
    return state
"""
    assert lines(src, "SYNC001") == []


@pytest.mark.parametrize("gate", ["time.time() - last", "step > 10", "log_metrics(step)", "step % 100 == 0 or verbose"])
def test_a_test_that_holds_on_most_steps_is_no_gate(gate):
    src = STEP + f"""
def log_metrics(step):
    return True

def train(state, data, verbose):
    last = time.time()
    for step, batch in enumerate(data):
        state, metrics = train_step(state, batch)
        if {gate}:
            print(float(metrics["loss"]))  # WAIT
    return state
"""
    assert lines(src, "SYNC001") == [line_of(src, "# WAIT")]


# a table of synchronous calls (TIME001) --------------------------------------------------------------

@pytest.mark.parametrize("between", [
    "compiled = jax.jit(train_step).lower(state, batch).compile()",
    "state, m = train_step(state, batch)\n    jax.block_until_ready(m)",
    "state, m = train_step(state, batch)\n    jax.tree_util.tree_map(lambda x: x.block_until_ready(), m)",
    "state, m = train_step(state, batch)\n    m = jax.device_get(m)",
    "state, m = train_step(state, batch)\n    progress(m)\n    jax.effects_barrier()",
])
def test_a_clock_read_after_a_synchronous_call_measures_the_work(between):
    src = STEP + f"""
def bench(state, batch, progress):
    t0 = time.time()
    {between}
    return time.time() - t0
"""
    assert lines(src, "TIME001") == []


def test_a_clock_read_after_dispatch_alone_is_reported():
    src = STEP + """
def bench(state, batch):
    t0 = time.time()
    state, m = train_step(state, batch)
    return time.time() - t0  # READ
"""
    assert lines(src, "TIME001") == [line_of(src, "# READ")]


def test_a_callback_handed_results_dispatches_nothing_after_a_wait():
    src = STEP + """
def loop(state, data, progress):
    start = time.time()
    for batch in data:
        print("elapsed", time.time() - start)
        state, m = train_step(state, batch)
        print(float(m["loss"]))
        progress(m)
    return state
"""
    assert lines(src, "TIME001") == []


# module-level aliases followed like imports -----------------------------------------------------------

def test_a_module_level_alias_is_followed_like_an_import():
    src = """\
import jax
import flax
pmap = jax.pmap
ju = flax.jax_utils
p_step = pmap(lambda x: x)
state = ju.replicate({"a": 1})
"""
    assert lines(src, "PMAP001") == [3, 5]
    assert lines(src, "PMAP003") == [6]


def test_an_alias_bound_twice_is_not_followed():
    src = """\
import flax
ju = flax.jax_utils
ju = object()
state = ju.replicate({"a": 1})
"""
    assert lines(src, "PMAP003") == []


# a project's own copy of a pmap-era helper -------------------------------------------------------------

HELPERS = """\
import jax
import jax.numpy as jnp

def replicate(tree):
    n = jax.local_device_count()
    return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), tree)

def unreplicate(tree):
    return jax.tree_util.tree_map(lambda x: x[0], tree)

def _unpmap(v):
    first = lambda x: x[0]
    return jax.tree_util.tree_map(first, v)

def shard_batch(xs):
    local_device_count = jax.local_device_count()
    def _prepare(x):
        return x.reshape((local_device_count, -1) + x.shape[1:])
    return jax.tree_util.tree_map(_prepare, xs)

def first(xs):
    return xs[0]

def shard_names(xs):
    return [x.reshape(-1) for x in xs]

def broadcast(x, shape):
    return jnp.broadcast_to(x, shape)

step = jax.pmap(lambda s, b: s)
state = replicate({"w": jnp.zeros(3)})  # PLACE
for batch in range(3):
    state = step(state, shard_batch(batch))  # PLACE
final = unreplicate(state)  # PLACE
params = _unpmap(state)  # PLACE
head = first([1, 2])
names = shard_names([])
wide = broadcast(jnp.zeros(1), (4,))
"""


def test_a_local_copy_of_a_helper_is_reported_at_its_calls_by_name_and_shape():
    expected = [i for i, text in enumerate(HELPERS.splitlines(), 1) if "# PLACE" in text]
    assert lines(HELPERS, "PMAP003") == expected


def test_a_distinctive_helper_name_from_a_project_module_is_reported_and_a_common_one_is_not():
    src = """\
from byol.utils import helpers
from vmoe.data import pjit_utils
scalars = helpers.get_first(scalars)
rng = helpers.bcast_local_devices(rng)
it = pjit_utils.prefetch_to_device(it, size=2)
x = helpers.replicate(x)
"""
    assert lines(src, "PMAP003") == [3, 4]


def test_a_library_helper_handed_to_a_tree_map_is_reported_where_it_is_named():
    src = """\
import tensorflow as tf
from praxis import py_utils
batch = tf.nest.map_structure(
    py_utils.reshard, batch)
"""
    assert lines(src, "PMAP003") == [4]


# the TPU era's configuration switches and backends ------------------------------------------------------

def test_legacy_configuration_and_tpu_driver_backends():
    src = """\
import jax
from jax.config import config
config.update("jax_xla_backend", "tpu_driver")
config.update("jax_backend_target", "grpc://10.0.0.1:8470")
jax.config.update("jax_array", True)
jax.config.update("jax_enable_x64", True)
if jax.config.jax_parallel_functions_output_gda:
    pass
x, y, z = jax.devices()[0].coords
"""
    assert lines(src, "REMOVED001") == [2, 5, 7]
    assert lines(src, "TPU001") == [3, 4, 9]


def test_generated_names_are_reported_with_the_changelogs_version():
    found = [f for f in check_source("import jax\nx = jax.soft_pmap\n") if f.rule == "REMOVED001"]
    assert len(found) == 1 and "0.3.18" in found[0].replacement


# the generated vocabulary -----------------------------------------------------------------------------------

def test_the_generated_names_are_all_in_the_removed_table():
    """Their absence here is checked with the hand-kept names' (tests/test_codecheck.py)."""
    assert len(CHANGELOG_REMOVED) > 200 and set(CHANGELOG_REMOVED) <= set(REMOVED)


@pytest.mark.slow
def test_the_generated_vocabulary_is_what_the_stored_changelogs_give(tmp_path):
    """Regenerating from bench/data/changelogs gives the committed module byte for byte."""
    out = tmp_path / "removed_api.py"
    subprocess.run([sys.executable, "bench/removed_api_candidates.py", "bench/data/changelogs/jax_CHANGELOG.md",
                    "--flax", "bench/data/changelogs/flax_CHANGELOG.md", "--write", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)
    assert out.read_text() == (ROOT / "migration" / "codecheck" / "removed_api.py").read_text()


def test_gate_functions_that_call_each_other_are_read_one_level_deep():
    """A gate helper calling another (or itself) must not recurse without end."""
    src = STEP + """
def due(step):
    ok = later(step)
    return ok

def later(step):
    ok = due(step - 1)
    return ok

def train(state, data):
    for step, batch in enumerate(data):
        state, metrics = train_step(state, batch)
        ready = due(step)
        if due(step):
            print(float(metrics["loss"]))  # WAIT
    return state
"""
    assert lines(src, "SYNC001") == [line_of(src, "# WAIT")]
