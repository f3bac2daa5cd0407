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


# an evaluation the training loop runs every N steps; schedules decided by another module ------------

EVAL_EVERY = STEP + """
@jax.jit
def eval_step(state, batch):
    return jnp.sum(batch)

for step, batch in enumerate(data):
    state, metrics = train_step(state, batch)
    if {gate}:
        total = 0.0
        for eval_batch in eval_data:
            out = eval_step(state, eval_batch)
            total += float(out)  # the eval read
"""


@pytest.mark.parametrize("gate, reported", [
    ("step % 1000 == 0", False),
    ("train_utils.itstime(step, config.log_eval_steps, total_steps)", False),  # another module's schedule
    ("utils.due(step, every=500)", False),
    ("config.run_eval", True),  # a setting: when set, the evaluation runs every step
    ("utils.ready(step, config)", True),  # handed the counter, but no interval: not a schedule
])
def test_an_evaluation_run_every_n_steps_pays_its_waits_every_n_steps(gate, reported):
    src = EVAL_EVERY.replace("{gate}", gate)
    assert lines(src, "SYNC001") == ([line_of(src, "the eval read")] if reported else [])


@pytest.mark.parametrize("keep, reported", [
    ("kept.append((jax.device_get(batch), jax.device_get(out)))", False),
    ("pair = (jax.device_get(batch), jax.device_get(out))\n    kept.append(pair)", False),
    ("kept.append(jax.tree_util.tree_map(np.copy, jax.device_get(out)))", False),
    ("kept.append((jax.device_get(out), float(out)))", True),  # a read among the copies
])
def test_an_evaluation_loop_collects_tuples_and_tree_maps_of_copies(keep, reported):
    src = STEP + "import numpy as np\n\n@jax.jit\ndef eval_step(state, batch):\n    return jnp.sum(batch)\n\n" \
        "kept = []\nfor batch in eval_data:\n    out = eval_step(state, batch)\n    " + keep + "  # kept\n"
    assert bool(lines(src, "SYNC001")) == reported


# pjit's keywords through a name bound to pjit ---------------------------------------------------------

@pytest.mark.parametrize("binding, reported", [
    ("maybe_pjit = pjit if on_tpu else emulated_pjit", True),
    ("maybe_pjit = pjit", True),
    ("from haliax import named_pjit as maybe_pjit", False),  # another library's wrapper with keywords so named
    ("def maybe_pjit(fn, in_axis_resources=None, out_axis_resources=None):\n    return fn", False),
])
def test_pjit_keywords_are_found_through_a_name_bound_to_pjit(binding, reported):
    src = ("from jax.experimental.pjit import pjit\n" + binding +
           "\nstep = maybe_pjit(train, in_axis_resources=(None,), out_axis_resources=None)  # call\n")
    assert lines(src, "PJIT001") == ([line_of(src, "# call")] if reported else [])


# libraries' collective wrappers; a project module's copy of shard ---------------------------------------

def test_a_libraries_collective_wrapper_under_pmap_is_a_collective():
    src = ("import jax\nimport kfac_jax\n\ndef evaluate(stats):\n    return kfac_jax.utils.pmean_if_pmap(stats, 'i')\n\n"
           "p_eval = jax.pmap(evaluate, axis_name='i')\n")
    assert lines(src, "PMAP002") == [5]


@pytest.mark.parametrize("call, reported", [
    ("batch = data_utils.shard(batch)", True),
    ("ds = ds.shard(jax.process_count(), jax.process_index())", False),  # a tf.data method
    ("batch = data_utils.shard(batch, num_shards=8)", False),  # not the one-argument helper's shape
    ("batch = tf_utils.shard(batch)", False),
])
def test_a_project_modules_shard_is_the_pmap_era_helper(call, reported):
    src = ("import jax\nimport tensorflow as tf_utils\nfrom myproject.data import data_utils\n\n"
           "for batch in data:\n    " + call + "\n")
    assert lines(src, "PMAP003") == ([6] if reported else [])


# timer objects and progress reporters ----------------------------------------------------------------

TIMED = STEP + """
from clu import periodic_actions
import train_utils
chrono = train_utils.Chrono()
tracker = utils.TimeTracker()
report_progress = periodic_actions.ReportProgress(num_train_steps=100)
for step, batch in enumerate(data):
{body}
"""


@pytest.mark.parametrize("body, marker", [
    ("    state, metrics = train_step(state, batch)\n    chrono.tick(step)  # end", "# end"),
    ("    state, metrics = train_step(state, batch)\n    if step % 100 == 0:\n        jax.block_until_ready(state)\n"
     "    chrono.tick(step)  # end", "# end"),  # the wait runs every 100 steps only
    ("    with tracker.record_time('step'):  # end\n        state, metrics = train_step(state, batch)", "# end"),
    ("    state, metrics = train_step(state, batch)\n    report_progress(step, time.time())  # end", "# end"),
    ("    tracker.tic('step')\n    state, metrics = train_step(state, batch)\n    tracker.toc('step')  # end", "# end"),
])
def test_a_timer_closing_its_interval_after_unwaited_work_is_reported(body, marker):
    src = TIMED.replace("{body}", body)
    assert lines(src, "TIME001") == [line_of(src, marker)]


@pytest.mark.parametrize("body", [
    "    state, metrics = train_step(state, batch)\n    jax.block_until_ready(state)\n    chrono.tick(step)",
    "    state, metrics = train_step(state, batch)\n    print(float(metrics['loss']))\n    chrono.tick(step)",
    # the interval restarts after the step: it times the input pipeline
    "    tracker.toc('data')\n    state, metrics = train_step(state, batch)\n    tracker.tic('data')",
    # paused after the step: the tick reads an interval that ended before it
    "    state, metrics = train_step(state, batch)\n    chrono.pause()\n    chrono.tick(step)\n    chrono.resume()",
    "    with tracker.record_time('step'):\n        state, metrics = train_step(state, batch)\n"
    "        jax.block_until_ready(state)",
    "    state, metrics = train_step(state, batch)\n    report_progress(step)",  # no clock read handed to it
    "    state, metrics = train_step(state, batch)\n    chrono.summary()",  # reads no interval
])
def test_a_timer_after_a_wait_or_restarted_after_the_work_is_quiet(body):
    assert lines(TIMED.replace("{body}", body), "TIME001") == []


# RL environments, frameworks' per-step methods, evolution strategies --------------------------------

def test_an_action_handed_to_the_environment_is_no_training_wait():
    src = STEP + """
policy = jax.jit(lambda p, s: s)
for i in range(100):
    action = policy(params, state)
    next_state, reward, done, _ = env.step(int(action))  # acting
    state, metrics = train_step(state, batch)
    print(float(metrics["loss"]))  # a read
"""
    assert lines(src, "SYNC001") == [line_of(src, "# a read")]


JAXLINE = """\
import jax
import numpy as np
from jaxline import experiment

class Experiment({base}):
    def step(self, global_step, rng, writer, **unused_args):
        batch = next(self._train_input)
        self._params, scalars, logits = self._update_func(self._params, batch, rng)
        scalars["prediction"] = np.argmax(logits[0])  # the read
        return scalars
"""


@pytest.mark.parametrize("base, reported", [("experiment.AbstractExperiment", True), ("object", False)])
def test_jaxlines_step_method_is_read_as_one_iteration_of_the_training_loop(base, reported):
    src = JAXLINE.replace("{base}", base)
    found = [f for f in check_source(src) if f.rule == "SYNC001"]
    assert [f.line for f in found] == ([line_of(src, "# the read")] if reported else [])
    if reported:
        assert "`Experiment.step`, which jaxline runs every training step" in found[0].message


@pytest.mark.parametrize("call, reported", [
    ("x, es_state = strategy.ask(rng, es_state, params)", True),
    ("x = self.solver.ask()", True),
    ("position = f.tell()", False),  # a file's position
])
def test_an_evolution_strategys_ask_and_tell_are_its_update_step(call, reported):
    src = "import time\nimport jax\nfor i in range(10):\n    t0 = time.perf_counter()\n    " + call + \
        "\n    print(time.perf_counter() - t0)  # read\n"
    assert lines(src, "TIME001") == ([line_of(src, "# read")] if reported else [])


# timing: waits every N steps, where a read is reported, intervals within one iteration ---------------

def test_a_wait_taken_every_n_steps_does_not_settle_the_epochs_timing():
    src = STEP + """
for epoch in range(10):
    t0 = time.time()
    for i, batch in enumerate(data):
        state, metrics = train_step(state, batch)
        if i % 100 == 0:
            print(jax.device_get(metrics))
    epoch_s = time.time() - t0  # read
"""
    assert lines(src, "TIME001") == [line_of(src, "# read")]


def test_a_wait_behind_a_setting_is_taken_as_the_path_that_runs():
    src = STEP + """
t0 = time.time()
state, metrics = train_step(state, batch)
if not concurrent:
    metrics = jax.device_get(metrics)
print(time.time() - t0)
"""
    assert lines(src, "TIME001") == []


def test_a_clock_read_is_reported_on_the_line_of_the_subtraction():
    src = STEP + """
for i in range(10):
    t0 = time.perf_counter()
    state, metrics = train_step(state, batch)
    logger.debug('step time: {:.4f}s'.format(
        time.perf_counter() - t0))  # read
    t0 = time.perf_counter()
"""
    assert lines(src, "TIME001") == [line_of(src, "# read")]


# vendored libraries, jaxline's psum, removed array attributes ---------------------------------------

def test_a_vendored_ninjax_pmap_is_a_pmap_and_jaxlines_tree_psum_a_psum():
    src = ("import jax\nfrom . import ninjax as nj\nfrom jaxline import utils as jl_utils\n\n"
           "def update(grads):\n    return jl_utils.tree_psum(grads, axis_name='i')\n\n"
           "p_update = nj.pmap(update, 'i')\n")
    assert lines(src, "PMAP001") == [8] and lines(src, "PMAP002") == [6]
    assert lines("import jax\nfrom . import utils as nj\np = nj.pmap(f)\n", "PMAP001") == []


@pytest.mark.parametrize("attr, reported", [("device_buffer", True), ("device_buffers", True), ("buffer", False)])
def test_the_old_device_arrays_buffers_are_removed(attr, reported):
    src = f"import jax\nleaves = jax.tree_util.tree_map(lambda x: x[0].{attr}, params)\n"
    assert lines(src, "REMOVED001") == ([2] if reported else [])


# placement helpers: a devices parameter, a class's own constructor, a project's de_replicate ----------

def test_a_method_taking_devices_with_a_placement_shape_is_a_helper():
    src = """\
import jax

class Agent:
    def _convert(self, value, devices):
        return jax.tree_util.tree_map(lambda x: x.reshape((len(devices), -1) + x.shape[1:]), value)

    def _log(self, value, devices):
        print(value, devices)

    def train(self, data):
        batch = self._convert(data, self.devices)  # placed
        self._log(data, self.devices)
"""
    assert lines(src, "PMAP003") == [line_of(src, "# placed")]


def test_a_method_of_an_object_made_by_its_class_constructor_is_followed():
    src = """\
import jax
from flax import jax_utils

class TrainState:
    @classmethod
    def create(cls, params):
        return cls()

    def replicate(self):
        return jax_utils.replicate(self)

state = TrainState.create(params)
state = state.replicate()  # placed
"""
    assert line_of(src, "# placed") in lines(src, "PMAP003")


@pytest.mark.parametrize("name, reported", [("de_replicate", True), ("dereplicate", True), ("replicate_rows", False)])
def test_a_project_modules_de_replicate_is_unreplicate(name, reported):
    src = f"import jax\nfrom project import train_utils\nstate_to_save = train_utils.{name}(state)\n"
    assert lines(src, "PMAP003") == ([3] if reported else [])


@pytest.mark.parametrize("code, reported", [
    ("outputs = {'pred': pred.astype('float16'), 'id': ids}", False),  # kept to be written
    ("x = x.astype('float16')", True),
    ("outputs = [pred.astype('float16')]", True),
])
def test_half_precision_for_results_being_kept_is_not_a_compute_dtype(code, reported):
    assert bool(lines("import jax\n" + code + "\n", "FP16001")) == reported
