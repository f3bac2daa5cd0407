"""Value tracking that follows real code (SYNC001, TIME001): each false alarm and miss seen on real
TPU-era scripts, as a small case of the same shape."""

from __future__ import annotations

from migration.codecheck import check_source


def rules(src: str, rule: str) -> list[int]:
    return [f.line for f in check_source(src, "t.py") if f.rule == rule]


def test_a_timed_step_of_this_file_that_ends_in_numpy_is_waited_for():
    src = """import time
import numpy as np
import jax

def train_step(network, batch):
    loss, norm = network.train({"x": batch})
    return np.array(loss).mean(), np.array(norm).mean()

def main(network, batches):
    start = time.time()
    loss, norm = train_step(network, next(batches))
    print(f"compiled in {time.time() - start:.2f}s")
    for batch in batches:
        loss, norm = train_step(network, batch)
        print(loss)
"""
    assert rules(src, "TIME001") == []
    # the wait inside the step function is itself the per-step sync (reported where it is)
    assert rules(src, "SYNC001") == [7]


def test_optax_transformations_are_host_objects():
    src = """import time
import optax
import jax

def main(path, params, batches):
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 100, 1000)
    start = time.time()
    restored = read_checkpoint(path, tx)
    print(f"loaded in {time.time() - start:.1f}s")
"""
    assert rules(src, "TIME001") == []
    grads_src = """import time
import optax
import jax

def main(params, updates):
    start = time.time()
    params = optax.apply_updates(params, updates)
    print(time.time() - start)
"""
    assert rules(grads_src, "TIME001") == [8]  # apply_updates computes arrays: that timing is dispatch


def test_results_of_a_step_that_returns_host_floats_are_not_device_values():
    src = """import jax
import numpy as np
import wandb

def train_step(state, batch):
    state, loss = p_train_step(state, batch)
    loss = jax.device_get(loss)
    return state, float(np.mean(loss))

def main(state, batches):
    for step, batch in enumerate(batches):
        state, loss = train_step(state, batch)
        wandb.log({"loss": loss}, step)
"""
    lines = rules(src, "SYNC001")
    assert 13 not in lines  # logging a float is free
    assert lines == [7]  # the device_get inside the step is the wait


def test_a_loop_over_metric_names_carries_names_not_device_values():
    src = """import jax

def write(summary, metrics, step):
    for name in metrics["scalar"]:
        print(f"writing {name}")
        summary[name] = metrics["scalar"][name]
    for key in metrics.get("scalars", []):
        print(key)
        summary[key] = metrics["scalars"][key]

def main(state, batches, summary):
    for step, batch in enumerate(batches):
        state, metrics = train_step(state, batch)
        write(summary, metrics, step)
"""
    assert rules(src, "SYNC001") == []
    values_src = src.replace('print(f"writing {name}")', 'print(f"writing {metrics[\'scalar\'][name]}")')
    assert rules(values_src, "SYNC001") == [5]  # the value under the key is still the device's


def test_a_sync_inside_the_step_function_is_found():
    src = """import jax
import numpy as np

class CheckpointingUpdater:
    def __init__(self, inner):
        self._inner = inner

    def update(self, state, data):
        step = np.array(state["step"])
        if step % 1000 == 0:
            save(jax.device_get(state))
        return self._inner.update(state, data)

def main(inner, state, batches):
    updater = CheckpointingUpdater(inner)
    for data in batches:
        state, metrics = updater.update(state, data)
"""
    assert rules(src, "SYNC001") == [9]


def test_state_kept_on_an_object_attribute_is_a_device_value():
    src = """import jax

def main(network, batches, scheduler):
    for batch in batches:
        loss = train_step(network, batch)
        lr = float(scheduler(network.state["opt_state"].count.item()))
        log(lr)
"""
    assert rules(src, "SYNC001") == [6]
    cls_src = """import jax

class Trainer:
    def fit(self, batches):
        for batch in batches:
            self.state, loss = self.p_train_step(self.state, batch)
            self.report()

    def report(self):
        print(float(self.state.step))
"""
    assert rules(cls_src, "SYNC001") == [10]


def test_a_dict_update_is_not_a_step_and_an_eval_loop_may_fetch_its_outputs():
    src = """import jax

def main(state, batches, eval_batches):
    for epoch in range(3):
        for batch in batches:
            state, metrics = train_step(state, batch)
        stats = {}
        stats.update(extra)
        print(f"epoch {epoch} loss {metrics['loss']}")
        preds = []
        for batch in eval_batches:
            ids = p_generate_step(state.params, batch)
            preds.extend(jax.device_get(ids))
"""
    assert rules(src, "SYNC001") == []
    scalar_src = src.replace("preds.extend(jax.device_get(ids))", "correct = int(ids.sum())")
    assert rules(scalar_src, "SYNC001") == [13]  # a scalar read each evaluation step still waits


def test_a_clock_carried_over_a_loop_that_waits_measures_whole_iterations():
    src = """import time
import jax

def main(state, batches):
    last = time.time()
    for step, batch in enumerate(batches):
        state, metrics = train_step(state, batch)
        if step % 100 == 0:
            rate = 100 / (time.time() - last)
            last = time.time()
            print({k: float(v) for k, v in metrics.items()}, rate)
"""
    assert rules(src, "TIME001") == []
    no_wait = src.replace("print({k: float(v) for k, v in metrics.items()}, rate)", "print(rate)")
    assert rules(no_wait, "TIME001") == [9]


def test_a_file_without_jax_has_no_device_values():
    src = """import time
from cluster import build_model

def main(batches):
    t = build_model()
    start = time.time()
    for batch in batches:
        loss = t.train(batch)
        print(f"loss {loss}")
    print(time.time() - start)
"""
    assert rules(src, "SYNC001") == [] and rules(src, "TIME001") == []
    assert rules("import jax\n" + src, "SYNC001") == [10]


def test_calls_that_run_many_steps_are_not_steps():
    src = """import time
import jax

def bench(config, workdir):
    start = time.time()
    train_and_evaluate(config, workdir)
    return time.time() - start

def main(state, epochs):
    for epoch in range(epochs):
        state, metrics = train_epoch(state, epoch)
        print(f"epoch {epoch}: {metrics['loss']}")
"""
    assert rules(src, "TIME001") == [] and rules(src, "SYNC001") == []
    per_step = src.replace("train_epoch(state, epoch)", "train_step(state, epoch)")
    assert rules(per_step, "SYNC001") == [12]


def test_a_prediction_loop_may_bring_its_outputs_home_through_a_helper():
    src = """import jax
import numpy as np

def tohost(x):
    return np.array(x).reshape((-1,) + x.shape[2:])

def predict(params, batches):
    out = []
    for batch in batches:
        predicted = p_pred_step(batch, params)
        predicted = tohost(predicted)
        out.extend(predicted)
    return out
"""
    assert rules(src, "SYNC001") == []
    training = src.replace("p_pred_step", "p_train_step")
    assert rules(training, "SYNC001") == [5]  # in a training loop the same copy waits every step
