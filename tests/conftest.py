"""Test setup: the CPU backend with 8 XLA CPU devices, set before JAX is first imported, in the
planner worker's environment (deviceless GPU and TPU compiles allowed, XLA's own rematerialisation
off, machine code unoptimised: migration/running/worker_env.py compile_environment), so that tests can
compile for catalog GPUs and TPU slices in-process exactly as a planner worker does.

The processes the tests start (workers, servers, command lines) get the caller's flags plus that last
one, NO_CODEGEN_OPTIMISATION: they run a few steps of tiny models, so optimising their machine code
costs far more than it saves (the numerics tests take about 45% less CPU time). It changes neither the
math nor the memory figures: buffer assignment comes before code generation, and
test_memory_properties.py::test_a_candidate_compiled_in_a_compile_worker_gives_the_figures_of_one_compiled_here
and ::test_the_machine_codes_optimisation_changes_no_figure compare figures compiled with and without it.
The tests' own in-process compiles (the xdist workers') also build their CPU fusions with XLA's elemental
emitters instead of its MLIR fusion emitters (LEGACY_CPU_EMITTERS): a CPU compile takes a third of the time
(the tiny MoE's step on 8 devices 2.97 -> 1.05 s, a tiny transformer's 1.12 -> 0.40 s). It fuses a little
differently (a CPU program's temporary bytes move by a few hundred in millions: the tiny MoE's 12,929,056 ->
12,929,440), so it stays out of the environment the processes the tests start inherit, and out of every key
of compiled figures: those keys carry the environment's XLA_FLAGS, which the compile store's entries were
written under. The product's own processes never take it: a user's CPU plan is compiled as the CPU run that
follows it is.
What a user's run does with XLA's default flags is measured by the benchmarks (bench/), which this
setup does not touch."""

import atexit
import os
import pickle
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from migration.running.worker_env import DISABLE_XLA_REMAT, LIBTPU_COMPILE_ONLY, NO_CODEGEN_OPTIMISATION  # noqa: E402

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
for _name, _value in LIBTPU_COMPILE_ONLY.items():
    os.environ.setdefault(_name, _value)
LEGACY_CPU_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
_outer_xla_flags = os.environ.get("XLA_FLAGS")
os.environ["XLA_FLAGS"] = " ".join(f for f in (_outer_xla_flags or "", DISABLE_XLA_REMAT, NO_CODEGEN_OPTIMISATION,
                                                LEGACY_CPU_EMITTERS) if f)

# JAX's persistent compilation cache for the tests' own in-process compiles (the Trainer's steps, the
# planner's CPU-backend compiles), as the run workers already have theirs: a program one test compiled,
# the next one loads, across xdist workers (the first process to import this file makes the folder and
# its workers inherit it) and, under bench/mutation.py, across mutants. JAX decides whether a process
# uses the cache at its first compile, so it is set before the one below. On 2 cores, 2026-12-07: the suite's
# summed test time 3,572 s without a cache for these compiles, 3,039 s with one (set through JAX's environment
# variables for that run; tests/test_expert_parallel.py 238 -> 148 s); README's test line in a fresh clone with
# this setting, 24 min 43 s against 30 min 17 s before. A deviceless GPU or TPU compile found there cannot be
# loaded back (JAX warns and compiles).
JAX_CACHE_ENV = "MIGRATION_TEST_JAX_CACHE"
if not os.environ.get(JAX_CACHE_ENV):
    _reuse = os.environ.get("MIGRATION_TEST_REUSE")
    _jax_cache = Path(_reuse) / "jax-cache" if _reuse else Path(tempfile.mkdtemp(prefix="migration-tests-jax-"))
    os.environ[JAX_CACHE_ENV] = str(_jax_cache)
    if not _reuse:
        atexit.register(shutil.rmtree, _jax_cache, True)

# One temporary folder for the run, removed at its end: gradio_client leaves an empty folder in the system's
# temporary folder for every file it downloads (its _download_file moves the file out and keeps the folder),
# 4,000 of them a day of test runs here. The processes the tests start inherit TMPDIR; pytest's own
# folders (tmp_path) stay where they were, so a failed test's files are still there to read.
TMP_ENV = "MIGRATION_TEST_TMP"
if not os.environ.get(TMP_ENV):
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    _tmp = Path(tempfile.mkdtemp(prefix="migration-tests-tmp-"))
    os.environ[TMP_ENV] = os.environ["TMPDIR"] = str(_tmp)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    atexit.register(shutil.rmtree, _tmp, True)

import jax  # noqa: E402
import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402

from migration.common import enable_compile_cache  # noqa: E402

enable_compile_cache(os.environ[JAX_CACHE_ENV])
# XLA reads XLA_FLAGS once, at its first compile: compile now, then give the processes the tests start
# the caller's flags and unoptimised machine code (they set their own on top).
jax.jit(lambda x: x + 1)(1.0).block_until_ready()
os.environ["XLA_FLAGS"] = " ".join(f for f in (_outer_xla_flags or "", NO_CODEGEN_OPTIMISATION) if f)

from migration.config.requests import RunConfig  # noqa: E402
from tests.budget import pytest_sessionstart, pytest_terminal_summary, whole_suite  # noqa: E402,F401 (hooks)
from tests.budget import pytest_sessionfinish as budget_sessionfinish  # noqa: E402
from migration.step.policies import DynamicLossScale  # noqa: E402
from migration.step.train import TrainProgram, step_parts  # noqa: E402


class Trainer:
    """Runs a program in-process on the first `devices` CPU devices (for numerics tests), with the
    config's step style: the jit step, or the TPU-era pmap step (its state keeps the leading device
    axis; `run` returns device 0's metrics)."""

    def __init__(self, cfg: RunConfig, loss_scale: DynamicLossScale | None = None):
        self.program = TrainProgram.from_config(cfg, loss_scale=loss_scale)
        parts = step_parts(self.program, jax.devices()[: cfg.devices], cfg.step_style)
        self.mesh = parts.mesh
        self.state = parts.init_state()
        self.step, self.make, self._host_metrics = parts.step, parts.make_batch, parts.host_metrics

    def run(self, steps: int, start: int = 0) -> list[dict]:
        out = []
        for i in range(start, start + steps):
            self.state, metrics = self.step(self.state, self.make(i))
            out.append(self._host_metrics(jax.device_get(metrics)))
        return out


def session_root(tmp_path_factory) -> Path:
    """This test session's folder, shared by its xdist workers (each has its own folder below it)."""
    shared = os.environ.get("MIGRATION_TEST_REUSE")
    if shared:
        return Path(shared)
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


# Compiled figures the suite needs: a store keyed like the planner's own cache (migration/planning/
# compile_cache.py). A change to the code that shapes a compile makes its entries by request unreadable (a
# program left as it was is then lowered and found by its text); a change to the packages or to the code that
# reads figures makes everything compile again. `MIGRATION_UPDATE_COMPILE_STORE=1 python -m pytest` (the whole
# suite) writes it anew from the figures the run compiled and found.
COMPILE_STORE = Path(__file__).resolve().parent / "fixtures" / "compiled" / "figures.json.gz"


@pytest.fixture(scope="session", autouse=True)
def shared_caches(tmp_path_factory):
    """Every test, and every worker, planner and server it starts, keeps the service's files in this
    session's folder (never the user's ~/.cache) and shares one cache of compiled figures (the planner's
    figures, the CPU's measured peak, JAX's compilation cache), over the store above: a program one test
    compiled, another reads back, as the app's planner workers do. A test about the caches themselves
    asks for `cold_caches`."""
    root = session_root(tmp_path_factory)
    os.environ["MIGRATION_CACHE_DIR"] = str(root / "service")
    os.environ["MIGRATION_COMPILE_CACHE_DIR"] = str(root / "compiled")
    os.environ["MIGRATION_COMPILE_STORE"] = str(COMPILE_STORE)
    yield root


@pytest.fixture
def cold_caches(tmp_path, monkeypatch):
    """A cold start, as a new user's first plan: this test's own empty caches and no store."""
    monkeypatch.setenv("MIGRATION_CACHE_DIR", str(tmp_path / "cold-cache"))
    monkeypatch.setenv("MIGRATION_COMPILE_CACHE_DIR", str(tmp_path / "cold-cache"))
    monkeypatch.delenv("MIGRATION_COMPILE_STORE", raising=False)
    return tmp_path / "cold-cache"


def pytest_sessionfinish(session, exitstatus):
    """With MIGRATION_UPDATE_COMPILE_STORE=1, a whole-suite run writes the store anew from every cache of
    compiled figures it made (its own folder's, and those of the tests' own cold caches), whatever the
    tests' outcome: every figure is keyed by what made it."""
    budget_sessionfinish(session, exitstatus)
    if (os.environ.get("MIGRATION_UPDATE_COMPILE_STORE") != "1" or hasattr(session.config, "workerinput")
            or not whole_suite(session.config)):
        return
    from migration.planning.compile_cache import CACHE_FILE, write_store

    root = session.config._tmp_path_factory.getbasetemp()
    count = write_store(COMPILE_STORE, sorted(root.rglob(CACHE_FILE)))
    print(f"\nwrote {count} compiled figures to {COMPILE_STORE.relative_to(Path(__file__).resolve().parent.parent)}")


def reused(name: str, make, tmp_path_factory):
    """`make(folder)`: a costly fixture's value (real plans and runs, made in `folder`), made once per
    test session and read back by every test file and xdist worker that asks for it (the first to
    ask makes it under a file lock; the others wait and read it). Under bench/mutation.py
    (MIGRATION_TEST_REUSE names a folder) it is made once per mutation run, by the unmutated code
    while mutmut learns which tests reach which function, so that a mutant pays for its tests and
    not for the fixture's runs."""
    root = session_root(tmp_path_factory)
    folder, saved = root / name, root / f"{name}.pickle"
    with FileLock(str(root / f"{name}.lock")):
        if saved.exists():
            return pickle.loads(saved.read_bytes())
        folder.mkdir(parents=True, exist_ok=True)
        value = make(folder)
        saved.write_bytes(pickle.dumps(value))
        return value


@pytest.fixture
def trainer():
    return Trainer


@pytest.fixture(scope="session")
def app_server(tmp_path_factory):
    """The launched app with no extra flags, started once for every test that needs no other flags
    (tests/test_app.py, tests/test_browser.py): each start imports JAX and Gradio, many seconds on
    2 cores. The tests that share it read their own client sessions and jobs, and of the history
    only what they add (counts before and after, their newest rows)."""
    from tests.server import Server

    s = Server(tmp_path_factory.mktemp("app"))
    yield s
    s.close()


# The suite runs on two pytest-xdist workers, a file at a time each, handed out in collection order
# (pytest.ini: --dist loadfile --no-loadscope-reorder; without the latter xdist hands out the files with
# the most tests first, whatever their time). The files that take longest go first, so that none of them
# starts last while the other worker sits idle: the thirty longest of a whole-suite run on the 2-core VM
# (`python bench/suite_time.py` lists them; 2026-12-05).
LONGEST_FIRST = ("test_app.py", "test_faults.py", "test_numerics.py", "test_ray.py", "test_runner.py", "test_attacks.py",
                 "test_your_model.py", "test_tpu_jobs.py", "test_layouts.py", "test_before_after.py", "test_benches.py",
                 "test_codecheck_fix.py", "test_multiprocess.py", "test_planner.py", "test_serving_run.py",
                 "test_published_ci.py", "test_sharding.py", "test_fp8.py", "test_app_serve.py",
                 "test_security_and_input.py", "test_registered_workload.py", "test_browser.py", "test_autotune.py",
                 "test_serving_plan.py", "test_memory_properties.py", "test_serving_tp.py", "test_decode.py",
                 "test_tpu_source.py", "test_workloads.py", "test_checkpoint.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# A llama tiny trained a few steps (untied head, FSDP over 2 devices) and saved as a checkpoint: the
# export and serving tests read it as a user's trained model.
TRAINED_LLAMA = RunConfig(workload="llama", preset="tiny", model={"tied_embeddings": False}, per_device_batch=2,
                          devices=2, sharding="fsdp", steps=4, warmup_steps=1, precision="fp32", learning_rate=3e-3)


def train_and_save(cfg: RunConfig, folder: Path):
    """`cfg` trained its steps on this machine's first devices and saved as a checkpoint in `folder`; the state."""
    # reason: the checkpoint module imports Orbax, which only these tests need
    from migration.running import checkpoint

    program = TrainProgram.from_config(cfg)
    parts = step_parts(program, jax.devices()[: cfg.devices])
    state = parts.init_state()
    for i in range(cfg.steps):
        state, _ = parts.step(state, parts.make_batch(i))
    checkpoint.save(folder, state, cfg, program, "cpu", jax.devices()[0].device_kind)
    return state


def served_and_greedy(cfg, params, model_cls, prompts: list[list[int]], gens: list[int]):
    """(served, expected): the tokens a greedy server of the checkpoint's `params` gives for each prompt, and
    those the training model (`model_cls`, built with other random weights, then given `params`) gives by its
    own forward, the likeliest token each time."""
    # reason: flax and the serving module are only these tests'
    from flax import nnx

    from migration.running.serving import Server
    from workloads.base import no_wrap

    model = model_cls(cfg, dtype=jax.numpy.float32, block_wrap=no_wrap, rngs=nnx.Rngs(123))
    nnx.update(model, params)
    server = Server(cfg, "fp32", batch=2, max_len=32, temperature=0.0, seed=123, state=params)
    return server.serve(prompts, gens)["tokens"], greedy_continuations(model, prompts, gens)


def greedy_continuations(model, prompts: list[list[int]], gens: list[int]) -> list[list[int]]:
    """Each prompt continued `gen` tokens by the model's own forward, the likeliest token each time."""
    out = []
    for prompt, gen in zip(prompts, gens):
        seq = list(prompt)
        for _ in range(gen):
            seq.append(int(jax.numpy.argmax(model(jax.numpy.asarray([seq]))[0, -1])))
        out.append(seq[len(prompt):])
    return out


@pytest.fixture(scope="module")
def trained_llama_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "llama"
    train_and_save(TRAINED_LLAMA, folder)
    return folder

