"""SYNC001 (host synchronisation in a step loop) and TIME001 (timing without waiting): which source
patterns are reported, on which line, and which near misses are not; the monitoring facts and the rule
table's Markdown."""

from __future__ import annotations

import textwrap

import pytest

from migration.codecheck import RULES, Rule, check_source, check_sources, rules_markdown


def lines(src: str, rule: str) -> list[int]:
    return [f.line for f in check_source(textwrap.dedent(src)) if f.rule == rule]


def findings(src: str, rule: str) -> list:
    return [f for f in check_source(textwrap.dedent(src)) if f.rule == rule]


# SYNC001 ----------------------------------------------------------------------------------------------

STEP = "for step, batch in enumerate(data):\n    state, loss = train_step(state, batch)\n"


@pytest.mark.parametrize("body, line", [
    # a branch on this step's loss makes the host wait for it
    ("    if loss > 10.0:\n        break\n", 3),
    ("    assert not jnp.isnan(loss)\n", 3),
    ("    while loss > 1.0:\n        loss = loss / 2\n", 3),
    ("    stop = loss < 1e-3\n    if stop:\n        break\n", 4),
    # a branch on host values does not
    ("    if step > 100:\n        break\n", None),
    ("    assert batch is not None\n", None),
])
def test_a_branch_on_the_steps_result_is_reported_on_the_branch(body, line):
    got = findings(STEP + body, "SYNC001")
    assert [f.line for f in got] == ([line] if line else [])
    if line:
        assert got[0].message.startswith("a branch on a device value converts it to a Python bool in the step loop "
                                         "at line 1")
        assert got[0].severity == "warning"


def test_a_conditional_expression_on_the_loss_is_reported():
    got = findings(STEP + '    label = "high" if loss > 1.0 else "low"\n', "SYNC001")
    assert [(f.line, f.col) for f in got] == [(3, 13)]
    assert got[0].message.startswith("a conditional expression on a device value converts it to a Python bool")
    assert lines(STEP + '    label = "high" if step > 1 else "low"\n', "SYNC001") == []


def test_a_conversion_names_the_call_and_the_step_loop():
    got = findings(STEP + "    print(float(loss))\n", "SYNC001")
    assert [(f.line, f.col) for f in got] == [(3, 11)]
    assert got[0].message == ("`float(...)` of a device array in the step loop at line 1: the host waits for the "
                              "device every step")
    assert got[0].replacement == RULES["SYNC001"].replacement


@pytest.mark.parametrize("head", [
    "    with writer.as_default(step=int(state.step)):\n        pass\n",
    "    match int(state.step):\n        case 0:\n            pass\n",
])
def test_a_conversion_in_a_with_or_match_head_is_reported(head):
    assert lines(STEP + head, "SYNC001") == [3]


@pytest.mark.parametrize("body, line", [
    # fetches every N steps are the remedy
    ("    if step % 100 == 0:\n        print(float(loss))\n", None),
    ("    if not step % 100:\n        print(float(loss))\n", None),
    ("    if step % 100:\n        pass\n    else:\n        print(float(loss))\n", None),
    ("    if step % 100:\n        continue\n    print(float(loss))\n", None),
    ("    if step % 100 != 0:\n        continue\n    print(float(loss))\n", None),
    ("    if not step % 100 == 0:\n        continue\n    print(float(loss))\n", None),
    ("    should_log = step % 100 == 0\n    if should_log:\n        print(float(loss))\n", None),
    ("    if step % 100 == 0 and verbose:\n        print(float(loss))\n", None),
    ("    if step % 100 == 0 or step == num_steps - 1:\n        print(float(loss))\n", None),
    ("    if step == 0:\n        print(float(loss))\n", None),
    ("    with lock:\n        if step % 100 == 0:\n            print(float(loss))\n", None),
    # a gate inside a gated block keeps the rest of that block gated
    ("    if step % 100 == 0:\n        if verbose:\n            pass\n        print(float(loss))\n", None),
    ("    if step % 10:\n        continue\n    if step % 100 == 0:\n        pass\n    print(float(loss))\n", None),
    # tests that hold on most steps are no gate
    ("    if step % 100 != 0:\n        print(float(loss))\n", 4),
    ("    if step % 100 == 0:\n        continue\n    print(float(loss))\n", 5),
    ("    if step % 100 == 0 or verbose:\n        print(float(loss))\n", 4),
    ("    if verbose and debug:\n        print(float(loss))\n", 4),
    ("    if step > 100:\n        print(float(loss))\n", 4),
    ("    if epoch == 3:\n        print(float(loss))\n", 4),
    ("    if step % 100 == 0:\n        print(float(loss))\n    print(float(loss))\n", 5),
])
def test_fetches_every_n_steps_are_not_reported_and_frequent_ones_are(body, line):
    assert lines(STEP + body, "SYNC001") == ([line] if line else [])


def test_a_while_loops_counter_gates_like_a_for_loops_variable():
    src = """\
    step = 0
    while step < num_steps:
        state, loss = train_step(state, next(it))
        step += 1
        if step == num_steps:
            print(float(loss))
        if epoch == 2:
            print(float(loss))
    """
    assert lines(src, "SYNC001") == [8]


def test_results_of_an_inner_step_loop_are_this_iterations():
    src = """\
    for epoch in range(3):
        state, aux = warmup_step(state, epoch)
        epoch_loss = 0.0
        for batch in data:
            state, loss = train_step(state, batch)
            epoch_loss = epoch_loss + loss
        print(float(aux))
        print(float(last))
        print(float(loss))
        print(float(epoch_loss))
        last = loss
    """
    # `aux`, `loss` and `epoch_loss` are from this epoch's steps; `last` from the previous epoch, long finished
    assert lines(src, "SYNC001") == [7, 9, 10]


def test_a_loop_over_a_device_array_yields_device_values():
    src = STEP + "    for row in jnp.split(loss, 4):\n        print(float(row))\n"
    assert lines(src, "SYNC001") == [4]
    host = STEP + "    for name in ('a', 'b'):\n        print(name)\n"
    assert lines(host, "SYNC001") == []


def test_a_previous_steps_result_waits_only_before_this_step_is_dispatched():
    before = """\
    for batch in data:
        scaled = loss * 2
        print(float(scaled))
        state, loss = train_step(state, batch)
    """
    assert lines(before, "SYNC001") == [3]
    rebound = """\
    for batch in data:
        total = 0.0
        print(f"start {total}")
        state, total = train_step(state, batch)
    """
    assert lines(rebound, "SYNC001") == []  # rebound to a host value before it is read


@pytest.mark.parametrize("src, line", [
    ("buf = []\nfor batch in data:\n    buf.append(prev)\n    print(np.mean(buf))\n"
     "    state, loss = train_step(state, batch)\n    prev = loss\n", 4),
    ("buf = []\nfor batch in data:\n    state, loss = train_step(state, batch)\n    buf.append(prev)\n"
     "    print(np.mean(buf))\n    prev = loss\n", None),
    ("buf = []\nfor batch in data:\n    state, loss = train_step(state, batch)\n    buf.append(loss)\n"
     "    print(np.mean(buf))\n", 5),
])
def test_a_list_holds_the_age_of_what_was_appended(src, line):
    assert lines(src, "SYNC001") == ([line] if line else [])


def test_one_finding_a_statement_the_first_wait():
    src = """\
    for batch in data:
        print(float(loss), float(jnp.sum(batch)))
        state, loss = train_step(state, batch)
    """
    assert [(f.line, f.col) for f in findings(src, "SYNC001")] == [(2, 11)]


def test_a_step_of_this_file_that_returns_host_values_is_reported_inside_it_only():
    src = """\
    import jax
    import numpy as np

    @jax.jit
    def _update(state, batch):
        return state

    def train_step(state, batch):
        loss = _update(state, batch)
        return np.array(loss).mean()

    for batch in data:
        loss = train_step(state, batch)
        print(loss)
    """
    got = findings(src, "SYNC001")
    assert [f.line for f in got] == [10]
    assert "(in `train_step`, called every step at line 13)" in got[0].message


def test_syncs_in_a_called_function_and_in_the_loop_are_both_reported():
    src = """\
    import jax

    def log(metrics):
        print(float(metrics))

    for batch in data:
        state, loss = train_step(state, batch)
        print(float(loss)); log(loss)
    """
    assert lines(src, "SYNC001") == [4, 8]


def test_a_recursive_helper_is_walked_once():
    src = """\
    import jax

    def log(metrics):
        print(float(metrics))
        log(metrics)

    for batch in data:
        state, loss = train_step(state, batch)
        log(loss)
    """
    assert lines(src, "SYNC001") == [4]


def test_a_helper_value_made_host_stays_host():
    src = """\
    import jax

    def log(loss):
        loss = float(loss)
        doubled = loss * 2
        print(f"loss {doubled}")

    for batch in data:
        state, loss = train_step(state, batch)
        log(loss)
    """
    assert lines(src, "SYNC001") == [4]


def test_a_helpers_own_step_counter_gates_its_fetch():
    src = """\
    import jax

    def log(metrics, step):
        if step == 0:
            print(float(metrics))

    for step, batch in enumerate(data):
        state, loss = train_step(state, batch)
        log(loss, step)
    """
    assert lines(src, "SYNC001") == []


@pytest.mark.parametrize("collect, line", [
    ("    preds.append(np.asarray(out))\n", None),
    ("    preds.append(jax.device_get(out))\n", None),
    ("    preds.append(jax.device_get(out))\n    print(float(out))\n", 7),
])
def test_an_evaluation_loop_may_collect_its_outputs(collect, line):
    src = ("import jax\nimport numpy as np\np_step = jax.jit(predict_fn)\nfor batch in data:\n"
           "    out = p_step(params, batch)\n" + collect)
    assert lines(src, "SYNC001") == ([line] if line else [])


def test_an_evaluation_loop_is_told_by_the_compiled_functions_name():
    train = ("import jax\nimport numpy as np\np_step = jax.jit(update_fn)\nfor batch in data:\n"
             "    out = p_step(params, batch)\n    preds.append(np.asarray(out))\n")
    assert lines(train, "SYNC001") == [6]


# TIME001 ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("src, expected", [
    # the step is dispatched, not finished, when the clock is read again
    ("t0 = time.perf_counter()\nstate = train_step(state, batch)\nfirst = time.perf_counter() - t0\n"
     "state = train_step(state, batch)\nsecond = time.perf_counter() - t0\n", [4, 6]),
    ("t0: float = time.perf_counter()\nstate = train_step(state, batch)\ndt = time.perf_counter() - t0\n", [4]),
    ("t0 = time.time()\nstate = train_step(state, batch)\nend = time.time(); print(end - t0)\n", [4]),
    ("t0 = time.perf_counter()\ngrads = jax.grad(lambda p: loss_fn(p, batch))(params)\n"
     "dt = time.perf_counter() - t0\n", [4]),
    ("t0 = time.time()\nstate, loss = train_step(state, batch)\nprint(f'step {i}')\ndt = time.time() - t0\n", [5]),
    # waited for: a copy to the host, a save, a function of this file that converts, block_until_ready
    ("t0 = time.time()\nstate, loss = train_step(state, batch)\nprint(f'loss {loss}')\ndt = time.time() - t0\n", []),
    ("t0 = time.time()\nstate = train_step(state, batch)\ncheckpointer.save(state)\ndt = time.time() - t0\n", []),
    ("t0 = time.time()\nstate = train_step(state, batch)\nmetrics = jax.device_get(trainer.metrics)\n"
     "dt = time.time() - t0\n", []),
    ("def log(value):\n    print(float(value))\n\nt0 = time.time()\nstate, loss = train_step(state, batch)\n"
     "log(loss)\ndt = time.time() - t0\n", []),
    ("t0 = time.perf_counter()\noutputs = train_step(params, batch)\njax.block_until_ready(outputs)\n"
     "outputs = list(outputs)\ndt = time.perf_counter() - t0\n", []),
    # not a measurement of JAX work
    ("t0 = time.time()\nstate = train_step(state, batch)\nage = deadline - t0\n", []),
    ("t0 = time.perf_counter()\nstate = train_step(state, batch)\nt0 = time.perf_counter()\nbatch = next(loader)\n"
     "load_time = time.perf_counter() - t0\n", []),
    ("t0 = time.perf_counter()\nstate = train_step(state, batch)\nt0 = time.perf_counter()\n"
     "dt = time.perf_counter() - t0\n", []),
    ("if warmup:\n    t0 = time.time()\n    state = train_step(state, batch)\nelse:\n    logger.info('no warmup')\n"
     "    done = True\n    print(time.time() - t0)\n", []),
])
def test_time001_reads_after_unwaited_work(src, expected):
    got = findings("import time\nimport jax\n" + src, "TIME001")
    assert [f.line - 1 for f in got] == expected


def test_time001_message_says_what_was_measured():
    got = findings(RULES["TIME001"].example, "TIME001")
    assert [f.line for f in got] == [4]
    assert got[0].message == ("the clock is read after a JAX call without waiting for it: this measures dispatch, "
                              "not the computation")
    assert got[0].severity == "warning"


@pytest.mark.parametrize("head", [
    "if time.perf_counter() - t0 > 1.0:\n    print('slow')\n",
    "while time.perf_counter() - t0 < budget:\n    time.sleep(0.1)\n",
    "for _ in range(int(time.perf_counter() - t0)):\n    pass\n",
    "with timer(time.perf_counter() - t0):\n    pass\n",
    "match time.perf_counter() - t0:\n    case _:\n        pass\n",
])
def test_a_clock_read_in_a_statement_head_is_reported_on_that_statement(head):
    src = "import time\nt0 = time.perf_counter()\nstate = train_step(state, batch)\n" + head
    assert lines(src, "TIME001") == [4]


@pytest.mark.parametrize("src, expected", [
    # work nested after the start is still pending at the read after the block
    ("if profile:\n    t0 = time.time()\n    state = train_step(state, batch)\ndt = time.time() - t0\n", [4]),
    ("for batch in data:\n    if log:\n        t0 = time.time()\n    state = train_step(state, batch)\n"
     "dt = time.time() - t0\n", [5]),
    # a read inside a loop follows the previous iterations' work, and what came before the loop
    ("t0 = time.time()\nfor batch in data:\n    print(f'elapsed {time.time() - t0:.1f}s')\n"
     "    state = train_step(state, batch)\n", [3]),
    ("t0 = time.time()\nstate = train_step(state, batch)\nfor i in range(3):\n    print(time.time() - t0)\n", [4]),
    # only what runs between the start and the read counts
    ("for batch in loader:\n    t0 = time.perf_counter()\n    batch = preprocess(batch)\n"
     "    prep_time = time.perf_counter() - t0\n    state = train_step(state, batch)\n", []),
    ("for batch in data:\n    state = train_step(state, batch)\n    t0 = time.time()\n    write_log(batch)\n"
     "io_time = time.time() - t0\n", []),
    ("state = train_step(state, batch)\nt0 = time.time()\nsave_json(path)\nif verbose:\n"
     "    print(time.time() - t0)\n", []),
    ("t0 = time.time()\nhost_io()\nif verbose:\n    print(time.time() - t0)\n    state = train_step(state, batch)\n",
     []),
])
def test_time001_follows_nested_blocks(src, expected):
    assert [n - 1 for n in lines("import time\n" + src, "TIME001")] == expected


@pytest.mark.parametrize("wait", [
    "    print(f'loss {loss}')\n",
    "    metrics = jax.device_get(loss)\n",
    "    checkpointer.save(state)\n",
    "    log(loss)\n",
    "    loss.block_until_ready()\n",
])
def test_a_per_iteration_clock_is_right_when_each_iteration_waits(wait):
    src = ("import time\nimport jax\n\ndef log(value):\n    print(float(value))\n\n"
           "t = time.time()\nfor batch in data:\n    state, loss = train_step(state, batch)\n"
           "    dt = time.time() - t\n" + wait + "    t = time.time()\n")
    assert lines(src, "TIME001") == []
    no_wait = src.replace(wait, "")
    assert lines(no_wait, "TIME001") == [10]


@pytest.mark.parametrize("src", [
    # the restart on the read's own line, or annotated
    "t = time.time()\nfor batch in data:\n    state, loss = train_step(state, batch)\n"
    "    dt = time.time() - t; t = time.time()\n    loss.block_until_ready()\n",
    "t: float = time.time()\nfor batch in data:\n    state, loss = train_step(state, batch)\n"
    "    dt = time.time() - t\n    loss.block_until_ready()\n    t: float = time.time()\n",
    # started at the end of an iteration, read in the next after a wait
    "for batch in data:\n    state = train_step(state, batch)\n    jax.block_until_ready(state)\n"
    "    if t0 is not None:\n        print(time.time() - t0)\n    t0 = time.time()\n",
])
def test_restarted_clocks_around_waited_iterations_are_not_reported(src):
    assert lines("import time\nimport jax\n" + src, "TIME001") == []


# monitoring and the rule table ------------------------------------------------------------------------

def test_every_pynvml_import_is_a_monitoring_use():
    src = ("import jax\nfrom pynvml import nvmlInit\nfrom pynvml import nvmlDeviceGetMemoryInfo\n"
           "from pynvml.smi import nvidia_smi\n")
    got = [(m.line, m.call, m.kind) for m in check_sources([("a.py", src)]).monitoring]
    assert got == [(2, "pynvml.nvmlInit", "utilisation"), (3, "pynvml.nvmlDeviceGetMemoryInfo", "memory"),
                   (4, "pynvml.nvidia_smi", "utilisation")]


def test_a_function_named_like_nvml_is_not_a_monitoring_use():
    src = "import jax\n\ndef nvml_available():\n    return True\n\nnvml_available()\n"
    assert check_sources([("a.py", src)]).monitoring == ()


def test_the_rule_table_escapes_pipes(monkeypatch):
    monkeypatch.setitem(RULES, "PIPE001", Rule("PIPE001", "info", "a | b", replacement="r", rationale="x | y",
                                               example=""))
    row = rules_markdown().splitlines()[-1]
    assert row == "| `PIPE001` | info | **a \\| b.** x \\| y |"
