"""The code check: every rule has a positive and a negative example; the TPU-era script is flagged;
nothing is ever executed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from migration.codecheck import (RULES, CodeCheck, CodeCheckError, check_files, check_paths, check_source,
                                 check_sources)
from migration.codecheck import SEVERITIES

ROOT = Path(__file__).resolve().parent.parent
TPU_ERA = ROOT / "tests" / "fixtures" / "codecheck" / "tpu_era_train.py"

# rule -> (positive: must be found, negative: nothing found)
CORPUS = {
    "TPU001": ("import jax\ndevs = jax.devices('tpu')\n",
               "import jax\ndevs = jax.devices()\n"),
    "PMAP001": ("import jax\nstep = jax.pmap(lambda x: x * 2)\n",
                "import jax\nstep = jax.jit(lambda x: x * 2)\n"),
    "PMAP002": ("import jax\nfrom jax import lax\n@jax.pmap\ndef f(g):\n    return lax.pmean(g, 'i')\n",
                "import jax\nimport jax.numpy as jnp\n@jax.jit\ndef f(g):\n    return jnp.mean(g)\n"),
    "REMOVED001": ("import jax\ny = jax.device_put_replicated(x, jax.devices())\n",
                   "import jax\nfrom jax.sharding import NamedSharding, PartitionSpec as P\ny = jax.device_put(x, NamedSharding(mesh, P()))\n"),
    "REMOVED002": ("import jax\njax.clear_backends()\n",
                   "import jax\njax.clear_caches()\n"),
    "PMAP003": ("from flax import jax_utils\nstate = jax_utils.replicate(state)\n",
                "import jax\nfrom jax.sharding import NamedSharding, PartitionSpec as P\n"
                "state = jax.device_put(state, NamedSharding(mesh, P()))\n"),
    "PJIT001": ("from jax.experimental.pjit import pjit\nstep = pjit(f, in_axis_resources=None)\n",
                "import jax\nstep = jax.jit(f, in_shardings=None, out_shardings=None)\n"),
    "TOPO001": ("import jax\nassert jax.device_count() == 8\n",
                "import jax\nmesh = jax.make_mesh((jax.device_count(), 1), ('data', 'model'))\n"),
    "BF16OPT001": ("import optax\nimport jax.numpy as jnp\ntx = optax.adam(1e-3, mu_dtype=jnp.bfloat16)\n",
                   "import optax\ntx = optax.adam(1e-3)\n"),
    "TPUENV001": ("import os\nargs = os.environ.get('LIBTPU_INIT_ARGS', '')\n",
                  "import os\nos.environ['XLA_FLAGS'] = '--xla_gpu_enable_latency_hiding_scheduler=true'\n"),
    "GCS001": ("import json\nwith open(f'gs://{bucket}/run/meta.json') as f:\n    meta = json.load(f)\n",
               "import json\nwith open(f'{checkpoint_dir}/meta.json') as f:\n    meta = json.load(f)\n"),
    "ENV001": ("import os\nimport jax\nos.environ['XLA_FLAGS'] = '--xla_dump_to=/tmp'\n",
               "import os\nos.environ['XLA_FLAGS'] = '--xla_dump_to=/tmp'\nimport jax\n"),
    "SYNC001": ("for batch in data:\n    state, loss = train_step(state, batch)\n    print(float(loss))\n",
                "losses = []\nfor batch in data:\n    state, loss = train_step(state, batch)\n    losses.append(loss)\n"),
    "TIME001": ("import time\nt0 = time.perf_counter()\nout = step(x)\ndt = time.perf_counter() - t0\n",
                "import time\nt0 = time.perf_counter()\nout = step(x).block_until_ready()\ndt = time.perf_counter() - t0\n"),
    "TRACE001": ("import jax\n@jax.jit\ndef f(x):\n    if x > 0:\n        return x\n    return -x\n",
                 "import jax\nimport jax.numpy as jnp\n@jax.jit\ndef f(x):\n    if x.ndim == 2:\n        x = x.sum(0)\n    return jnp.where(x > 0, x, -x)\n"),
    "SHAPE001": ("ds = ds.batch(128)\n",
                 "ds = ds.batch(128, drop_remainder=True)\n"),
    "BATCH001": ("global_batch_size = 4096\n",
                 "global_batch_size = 256\n"),
    "FP16001": ("import jax.numpy as jnp\nx = y.astype(jnp.float16)\n",
                "import jax.numpy as jnp\nloss_scale = 2.0 ** 15\nx = y.astype(jnp.float16)\n"),
    "PREC001": ("import jax\njax.config.update('jax_default_matmul_precision', 'bfloat16')\n",
                "import jax\njax.config.update('jax_enable_x64', False)\n"),
    "ATTN001": ("import jax\ndef attend(q, k, v):\n    return jax.nn.softmax(q @ k.T) @ v\n",
                "import jax\ndef attend(q, k, v):\n    return jax.nn.dot_product_attention(q, k, v, implementation='cudnn')\n"),
    "ROUTER001": ("import jax\nimport jax.numpy as jnp\ndef route(x, router_w):\n"
                  "    return jax.nn.softmax((x @ router_w).astype(jnp.bfloat16))\n",
                  "import jax\nimport jax.numpy as jnp\ndef route(x, router_w):\n"
                  "    return jax.nn.softmax((x @ router_w).astype(jnp.float32))\n"),
    "IGNORE001": ("import jax\ndevs = jax.devices('tpu')  # migration: ignore[TPU001]\n",
                  "import jax\ndevs = jax.devices('tpu')  # migration: ignore[TPU001] only runs on the pod fleet\n"),
}


def test_every_rule_has_a_corpus_entry():
    assert set(CORPUS) == set(RULES)


@pytest.mark.parametrize("rule", sorted(CORPUS))
def test_positive_example_is_found(rule):
    found = check_source(CORPUS[rule][0])
    assert rule in {f.rule for f in found}, found


@pytest.mark.parametrize("rule", sorted(CORPUS))
def test_negative_example_has_no_finding(rule):
    assert check_source(CORPUS[rule][1]) == []


def test_the_tpu_era_script_is_flagged_where_it_is_outdated():
    found = check_files([TPU_ERA])
    by_rule = {}
    for f in found:
        by_rule.setdefault(f.rule, []).append(f.line)
    text = TPU_ERA.read_text().splitlines()
    line_of = lambda needle: next(i + 1 for i, l in enumerate(text) if needle in l)
    assert by_rule["ENV001"] == [line_of('os.environ["XLA_FLAGS"]')]  # the env block before `import jax` is fine
    assert line_of('jax.devices("tpu")') in by_rule["TPU001"]
    assert line_of("partial(jax.pmap") in by_rule["PMAP001"]
    assert line_of("lax.pmean") in by_rule["PMAP002"]
    assert line_of("device_put_replicated") in by_rule["REMOVED001"]
    assert line_of("clear_backends") in by_rule["REMOVED002"]
    assert line_of("if x.sum() > limit") in by_rule["TRACE001"]
    assert line_of("GLOBAL_BATCH = 4096") in by_rule["BATCH001"]
    assert line_of(".batch(GLOBAL_BATCH") in by_rule["SHAPE001"]
    assert line_of("elapsed = time.time() - start") in by_rule["TIME001"]
    assert line_of('print("loss", float(') in by_rule["SYNC001"]
    for f in found:
        assert f.message and f.replacement and f.severity in ("error", "warning", "info")


def test_checking_never_executes_the_code(tmp_path):
    target = tmp_path / "written.txt"
    source = f"open({str(target)!r}, 'w').write('ran')\nimport os\nos.system('touch {target}')\n"
    path = tmp_path / "side_effects.py"
    path.write_text(source)
    check_files([path])
    check_source(source)
    assert not target.exists()


def test_not_python_and_too_large_get_clear_errors(tmp_path):
    with pytest.raises(CodeCheckError, match="not valid Python"):
        check_source("this is not python: at all(")
    with pytest.raises(CodeCheckError, match="limit"):
        check_source("x = 1\n" * 200_000)
    other = tmp_path / "notes.txt"
    other.write_text("x = 1")
    with pytest.raises(CodeCheckError, match="only .py"):
        check_files([other])


def test_cli_check_exits_non_zero_on_errors_and_writes_json_and_csv(tmp_path):
    out_json, out_csv = tmp_path / "f.json", tmp_path / "f.csv"
    proc = subprocess.run([sys.executable, "-m", "migration", "check", str(TPU_ERA), "--json", str(out_json),
                           "--csv", str(out_csv)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "REMOVED001" in proc.stdout and "device_put" in proc.stdout
    findings = json.loads(out_json.read_text())
    assert {f["rule"] for f in findings} >= {"TPU001", "PMAP001", "REMOVED002"}
    import pandas as pd

    assert len(pd.read_csv(out_csv)) == len(findings)
    clean = tmp_path / "clean.py"
    clean.write_text(CORPUS["TPU001"][1])
    ok = subprocess.run([sys.executable, "-m", "migration", "check", str(clean)], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0 and "no findings" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "migration", "check", str(tmp_path / "missing.py")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


# -- patterns the rules generalise to (each: source, rule, found?) ------------------------------
PATTERNS = [
    # ENV001: every way of setting the environment, after the import only
    ("import os\nimport jax\nos.environ['XLA_FLAGS'] += ' --xla_dump_to=/tmp'\n", "ENV001", True),
    ("import os\nos.environ['XLA_FLAGS'] += ' --xla_dump_to=/tmp'\nimport jax\n", "ENV001", False),
    ("import os\nimport jax\nos.environ.update({'XLA_PYTHON_CLIENT_PREALLOCATE': 'false'})\n", "ENV001", True),
    ("import os\nimport jax\nos.environ.update(JAX_ENABLE_X64='1')\n", "ENV001", True),
    ("import os\nimport jax\nos.environ.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '.5')\n", "ENV001", True),
    ("import os\nimport jax\nos.putenv('CUDA_VISIBLE_DEVICES', '0')\n", "ENV001", True),
    ("import os\nimport jax\nos.environ['XLA_FLAGS']: str = '--xla_dump_to=/tmp'\n", "ENV001", True),
    ("import os\nos.environ.setdefault('XLA_FLAGS', '')\nos.putenv('NCCL_DEBUG', 'WARN')\nimport jax\n",
     "ENV001", False),
    ("import os\nimport flax\nos.environ['XLA_FLAGS'] = ''\n", "ENV001", True),  # flax imports JAX
    ("import os\nimport jax\nos.environ['WANDB_MODE'] = 'offline'\n", "ENV001", False),
    # TPU001
    ("import jax\nassert jax.default_backend() == 'tpu'\n", "TPU001", True),
    ("import jax\nif jax.default_backend() == 'tpu':\n    pass\n", "TPU001", True),
    ("import jax\njax.config.update('jax_platform_name', 'tpu')\n", "TPU001", True),
    ("import jax\nd = jax.devices(backend='tpu')\n", "TPU001", True),
    ("import os\nos.environ['JAX_PLATFORMS'] = 'tpu'\nimport jax\n", "TPU001", True),
    ("import jax\nok = jax.devices()[0].platform == 'tpu'\n", "TPU001", True),
    ("import jax\nif jax.default_backend() == 'gpu':\n    pass\n", "TPU001", False),
    ("def f(args):\n    return args.platform == 'tpu'\n", "TPU001", False),
    ("import jax\nkind = jax.devices()[0].device_kind\nassert kind.startswith('TPU')\n", "TPU001", True),
    ("import jax\nbackend = jax.default_backend()\nprint(f'running on {backend}')\n", "TPU001", False),
    # TRACE001: jitted by call, static arguments honoured
    ("import jax\ndef f(x, n):\n    if n > 2:\n        return x\n    return -x\ng = jax.jit(f)\n", "TRACE001", True),
    ("import jax\ndef f(x, n):\n    if n > 2:\n        return x\n    return -x\ng = jax.jit(f, static_argnums=(1,))\n",
     "TRACE001", False),
    ("import jax\ndef f(x, n):\n    if n > 2:\n        return x\n    return -x\ng = jax.jit(f, static_argnames='n')\n",
     "TRACE001", False),
    ("import functools, jax\n@functools.partial(jax.jit, static_argnums=1)\ndef f(x, n):\n    while n > 0:\n"
     "        n -= 1\n    return x\n", "TRACE001", False),
    ("import functools, jax\n@functools.partial(jax.jit, static_argnums=1)\ndef f(x, n):\n    while x.sum() > n:\n"
     "        x = x / 2\n    return x\n", "TRACE001", True),
    # SYNC001: nested blocks and f-strings; gated fetches and host values are fine
    ("for b in data:\n    s, loss = train_step(s, b)\n    with ctx:\n        if verbose:\n"
     "            print(f'{loss:.3f}')\n", "SYNC001", True),
    ("for b in data:\n    s, loss = train_step(s, b)\n    try:\n        log.append(loss.item())\n"
     "    finally:\n        pass\n", "SYNC001", True),
    ("for i, b in enumerate(data):\n    s, loss = train_step(s, b)\n    if i % log_every == 0:\n"
     "        print(float(loss))\n", "SYNC001", False),
    ("for step, b in enumerate(data):\n    lr = base_lr * min(1.0, step / 100)\n"
     "    s, loss = train_step(s, b, float(lr))\n    n = int(step)\n", "SYNC001", False),
    ("losses = []\nfor b in data:\n    s, loss = train_step(s, b)\n    losses.append(loss)\n"
     "    print(np.mean(losses[-10:]))\n", "SYNC001", True),  # a list filled with device values
    ("for b in data:\n    s, m = train_step(s, b)\n    print({k: v.item() for k, v in m.items()})\n", "SYNC001", True),
    ("def log(m):\n    print(float(m['loss']))\nfor b in data:\n    s, m = train_step(s, b)\n    log(m)\n",
     "SYNC001", True),  # inside a function of the file, called every step
    ("pending = None\nfor b in data:\n    s, m = train_step(s, b)\n    if pending is not None:\n"
     "        print(float(pending))\n    pending = m\n", "SYNC001", False),  # one step behind: the device stays busy
    ("for step, b in enumerate(data):\n    s, m = train_step(s, b)\n    if step % 100:\n        continue\n"
     "    print(float(m))\n", "SYNC001", False),
    ("for b in data:\n    s, m = train_step(s, b)\n    history.append(m)\nprint(float(history[-1]))\n",
     "SYNC001", False),
    # TIME001: numpy-only work and waited-for work are fine; nested blocks are checked
    ("import time\nimport numpy as np\nt0 = time.time()\nnp.linalg.svd(a)\ndt = time.time() - t0\n", "TIME001", False),
    ("import time, jax\nt0 = time.time()\nout = step(x)\njax.block_until_ready(out)\ndt = time.time() - t0\n",
     "TIME001", False),
    ("import time\ndef bench(f, x):\n    for _ in range(3):\n        with mesh:\n            t0 = time.perf_counter()\n"
     "            y = train_step(x)\n            print(time.perf_counter() - t0)\n", "TIME001", True),
    ("import time\nstate = train_step(state, b)\nt0 = time.time()\nmanager.save(1, state)\n"
     "manager.wait_until_finished()\ndt = time.time() - t0\n", "TIME001", False),
    ("from datetime import datetime\nt0 = datetime.now()\ny = train_step(x)\ndt = datetime.now() - t0\n",
     "TIME001", True),
    ("import time\nt0 = time.time()\nfor _ in range(10):\n    y = train_step(x)\nnow = time.time()\nprint(now - t0)\n",
     "TIME001", True),
    # BATCH001: sizes, not counts
    ("NUM_BATCHES = 1000\nEVAL_BATCHES = 5000\nbatches_per_epoch = 4096\nnum_batches = 2048\n", "BATCH001", False),
    ("BATCH_SIZE: int = 4096\n", "BATCH001", True),
    ("per_device_batch = 1024\n", "BATCH001", True),
    ("config.global_batch_size = 4 * 1024\n", "BATCH001", True),
    ("parser.add_argument('--batch-size', type=int, default=2048)\n", "BATCH001", True),
    ("max_per_device_batch = 4096\ntokens_per_batch = 1 << 20\nbatch_idx = 600\n", "BATCH001", False),
    # FP16001: a dtype table or a comparison is not a choice of float16; loss scaling makes it fine
    ("import jax.numpy as jnp\nDTYPES = {'fp16': jnp.float16, 'bf16': jnp.bfloat16}\n", "FP16001", False),
    ("import jax.numpy as jnp\ndef f(x):\n    return x.dtype == jnp.float16\n", "FP16001", False),
    ("import jax.numpy as jnp\ny = x.astype('float16')\n", "FP16001", True),
    # REMOVED001: removed modules and names, at the import or the use
    ("from jax.experimental.maps import xmap\n", "REMOVED001", True),
    ("import jax\ny = jax.tree_map(f, x)\n", "REMOVED001", True),
    ("import jax\ny = jax.tree.map(f, x)\n", "REMOVED001", False),
    ("from jax.tools import colab_tpu\ncolab_tpu.setup_tpu()\n", "TPU001", True),
    ("import jax\nfrom jax import lax\n@jax.pmap\ndef f(x):\n    return x * lax.axis_index('i')\n", "PMAP002", True),
    ("import numpy as np\nimport jax\ndevs = np.array(jax.devices()).reshape(2, 4)\n", "TOPO001", True),
    ("import numpy as np\nimport jax\ndevs = np.array(jax.devices()).reshape(-1, 2)\n", "TOPO001", False),
    ("import jax\nassert len(jax.devices()) >= 1\n", "TOPO001", False),
    ("import jax\nmesh = jax.make_mesh((1, 1, 1), ('data', 'fsdp', 'model'))\n", "TOPO001", False),
    ("cores_per_replica = 8\nassert cores_per_replica <= 8\n", "TOPO001", True),
    ("import jax.numpy as jnp\ngrad_acc = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.bfloat16), params)\n",
     "BF16OPT001", True),
    ("import jax.numpy as jnp\ngrad_acc = jax.tree.map(jnp.zeros_like, params)\n", "BF16OPT001", False),
    ("import jax.numpy as jnp\nlogits = model(x).astype(jnp.bfloat16)\n", "BF16OPT001", False),
    # SHAPE001: torch's DataLoader, not any class of that name
    ("from torch.utils.data import DataLoader\nl = DataLoader(ds, batch_size=32)\n", "SHAPE001", True),
    ("import grain.python as grain\nl = grain.DataLoader(data_source=ds, sampler=s)\n", "SHAPE001", False),
    # PREC001: the fix is not flagged; relying on bf16 passes is
    ("import jax\nwith jax.default_matmul_precision('highest'):\n    y = x @ w\n", "PREC001", False),
    ("import jax\njax.config.update('jax_default_matmul_precision', 'float32')\n", "PREC001", False),
    ("import jax\nfrom jax import lax\ny = jax.numpy.dot(x, w, precision=lax.Precision.DEFAULT)\n", "PREC001", True),
    ("import jax\njax.config.update('jax_default_matmul_precision', 'fastest')\n", "PREC001", True),
]


@pytest.mark.parametrize("source,rule,expected", PATTERNS)
def test_rule_patterns(source, rule, expected):
    found = {f.rule for f in check_source(source)}
    assert (rule in found) == expected, check_source(source)


# -- silencing -------------------------------------------------------------------------------
def test_an_ignore_comment_with_a_reason_silences_the_named_rules_on_its_line():
    source = ("import jax\n"
              "a = jax.devices('tpu')  # migration: ignore[TPU001] the pod fleet only runs this file\n"
              "b = jax.devices('tpu')\n"
              "GLOBAL_BATCH = 4096; c = jax.devices('tpu')  # migration: ignore[BATCH001, TPU001] checked on the pod\n"
              "d = jax.devices('tpu')  # migration: ignore[BATCH001] this names another rule entirely\n")
    found = [(f.line, f.rule) for f in check_source(source)]
    assert found == [(3, "TPU001"), (5, "TPU001")]


@pytest.mark.parametrize("comment", ["# migration: ignore[TPU001]", "# migration: ignore[TPU001] pod",
                                     "# migration: ignore[TPU001] pod only", "# migration: ignore[TPU001]  # later"])
def test_an_ignore_comment_without_a_reason_silences_nothing_and_is_reported(comment):
    found = sorted(check_source(f"import jax\na = jax.devices('tpu')  {comment}\n"), key=lambda f: f.rule)
    assert [(f.line, f.rule, f.severity) for f in found] == [(2, "IGNORE001", "info"), (2, "TPU001", "error")]
    assert "reason" in found[0].message


def test_an_ignore_comment_naming_an_unknown_rule_is_reported():
    found = check_source("x = 1  # migration: ignore[TPU999] a reason in several words\n")
    assert [(f.rule, "TPU999" in f.message) for f in found] == [("IGNORE001", True)]


def test_ignore_text_inside_a_string_is_not_a_comment():
    source = "import jax\na = jax.devices('tpu'); s = '# migration: ignore[TPU001] a reason in words'\n"
    assert [f.rule for f in check_source(source)] == ["TPU001"]


# -- the project's own code --------------------------------------------------------------------
PROJECT_SOURCES = sorted(p for d in ("migration", "workloads", "ui", "bench") for p in (ROOT / d).rglob("*.py")) \
    + [ROOT / "app.py"]


def test_the_projects_own_code_passes_its_own_check():
    found = [f for f in check_files(PROJECT_SOURCES) if f.severity in ("error", "warning")]
    listing = "\n".join(f"{Path(f.file).relative_to(ROOT)}:{f.line} {f.rule} {f.message}" for f in found)
    assert not found, listing


# -- facts for the checklist -------------------------------------------------------------------
ENV_SOURCE = """\
import os
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")
os.environ["WANDB_MODE"] = "offline"
import jax
os.environ["XLA_FLAGS"] += " --xla_dump_to=/tmp/dump"
os.environ.update({"JAX_ENABLE_X64": "1"}, NCCL_DEBUG="WARN")
os.putenv("CUDA_VISIBLE_DEVICES", visible)
"""


def test_env_settings_record_every_setting_with_its_value_and_whether_it_precedes_the_import():
    result = check_sources([("launch.py", ENV_SOURCE)])
    got = [(e.line, e.name, e.value, e.before_import) for e in result.env_settings]
    assert got == [(2, "XLA_PYTHON_CLIENT_PREALLOCATE", "false", True),
                   (3, "XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8", True),
                   (6, "XLA_FLAGS", None, False),
                   (7, "JAX_ENABLE_X64", "1", False), (7, "NCCL_DEBUG", "WARN", False),
                   (8, "CUDA_VISIBLE_DEVICES", None, False)]
    assert all(e.file == "launch.py" for e in result.env_settings)
    assert sorted({f.line for f in result.findings if f.rule == "ENV001"}) == [6, 7, 8]


def test_env_settings_in_a_file_without_a_jax_import_count_as_before_it():
    result = check_sources([("env.py", "import os\nos.environ['XLA_FLAGS'] = '--xla_gpu_autotune_level=0'\n")])
    assert [(e.name, e.before_import) for e in result.env_settings] == [("XLA_FLAGS", True)]
    assert result.findings == ()


MONITORING_SOURCE = """\
import os
import subprocess
import jax
import pynvml as nv
from pynvml import nvmlInit
stats = jax.devices()[0].memory_stats()
nv.nvmlDeviceGetUtilizationRates(handle)
with jax.profiler.trace("/tmp/trace"):
    pass
jax.profiler.start_trace("/tmp/t")
jax.profiler.start_server(9999)
jax.profiler.save_device_memory_profile("mem.prof")
blob = jax.profiler.device_memory_profile()
subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv"])
subprocess.check_output("nvidia-smi -q", shell=True)
os.popen("nvidia-smi")
jax.monitoring.register_event_duration_secs_listener(lambda *a, **k: None)
subprocess.run(["ls", "-l"])
with jax.profiler.StepTraceAnnotation("train", step_num=1):
    jax.profiler.TraceAnnotation("x")
nv.nvmlDeviceGetMemoryInfo(handle)
"""


def test_monitoring_finds_every_kind_of_device_memory_or_utilisation_read():
    result = check_sources([("watch.py", MONITORING_SOURCE)])
    got = [(m.line, m.call, m.kind) for m in result.monitoring]
    # annotations name spans of someone else's trace and jax.monitoring sees compiles: neither is listed
    assert got == [(5, "pynvml.nvmlInit", "utilisation"), (6, "memory_stats", "memory"),
                   (7, "pynvml.nvmlDeviceGetUtilizationRates", "utilisation"), (8, "jax.profiler.trace", "trace"),
                   (10, "jax.profiler.start_trace", "trace"), (11, "jax.profiler.start_server", "trace"),
                   (12, "jax.profiler.save_device_memory_profile", "memory"),
                   (13, "jax.profiler.device_memory_profile", "memory"),
                   (14, "nvidia-smi", "utilisation"), (15, "nvidia-smi", "utilisation"),
                   (16, "nvidia-smi", "utilisation"), (21, "pynvml.nvmlDeviceGetMemoryInfo", "memory")]


def test_code_check_round_trips_through_json_and_keeps_files_apart():
    result = check_sources([("a.py", ENV_SOURCE), ("b.py", MONITORING_SOURCE), ("c.py", CORPUS["TPU001"][0])])
    assert result.files == ("a.py", "b.py", "c.py")
    assert {f.file for f in result.findings} == {"a.py", "c.py"}
    assert {m.file for m in result.monitoring} == {"b.py"}
    again = CodeCheck.from_dict(json.loads(json.dumps(result.to_dict())))
    assert again == result


def test_check_paths_matches_check_files_and_raises_the_same_errors(tmp_path):
    assert list(check_paths([TPU_ERA]).findings) == check_files([TPU_ERA])
    other = tmp_path / "notes.txt"
    other.write_text("x = 1")
    with pytest.raises(CodeCheckError, match="only .py"):
        check_paths([other])
    latin = tmp_path / "latin.py"
    latin.write_bytes(b"x = '\xe9'\n")
    with pytest.raises(CodeCheckError, match="UTF-8"):
        check_paths([latin])
    with pytest.raises(OSError):
        check_paths([tmp_path / "missing.py"])


def test_deeply_nested_expressions_are_checked_or_refused_clearly():
    chain = lambda n: "for b in data:\n    s, loss = train_step(s, b)\n    print(float(" + " + ".join(["loss"] * n) + "))\n"
    assert [f.rule for f in check_source(chain(300))] == ["SYNC001"]
    with pytest.raises(CodeCheckError, match="nested too deeply"):
        check_source(chain(20_000))


# -- the rule table (its page, docs/reference/rules.md, is generated: tests/test_docs.py) --------------


@pytest.mark.parametrize("rule_id", sorted(RULES))
def test_every_rule_has_its_metadata_and_its_example_triggers_it(rule_id):
    rule = RULES[rule_id]
    assert rule.id == rule_id and rule.severity in SEVERITIES
    for field in ("title", "replacement", "rationale", "example"):
        assert getattr(rule, field).strip(), f"{rule_id} has no {field}"
    assert "\n" not in rule.title
    found = check_source(rule.example, f"<{rule_id} example>")
    assert rule_id in {f.rule for f in found}, found


PJIT_ERA = """\
import functools
import jax
from jax.experimental import pjit as pjit_lib
from jax.experimental.pjit import pjit

p_step = pjit(train_step, in_axis_resources=(state_spec, P("data")), out_axis_resources=state_spec)
p_eval = pjit_lib.pjit(eval_step, in_axis_resources=None)
jitted = functools.partial(jax.jit, out_axis_resources=None)
fine = jax.jit(train_step, in_shardings=None)
other = some_library.compile(train_step, in_axis_resources=None)
"""


def test_pjit_keywords_are_found_on_pjit_jit_and_partial_only():
    found = [(f.line, f.rule) for f in check_source(PJIT_ERA) if f.rule == "PJIT001"]
    assert found == [(6, "PJIT001"), (7, "PJIT001"), (8, "PJIT001")]  # one per call
    first = next(f for f in check_source(PJIT_ERA) if f.rule == "PJIT001")
    assert first.replacement.startswith("in_shardings= and out_shardings=") and "TypeError" in first.message


def test_every_name_the_removed_list_holds_is_really_gone_from_the_installed_jax_and_flax():
    """REMOVED001 says "removed": each listed name, hand-kept or generated from the changelogs, must be
    absent (a module path that ends at a missing module, or a missing attribute) in the JAX and Flax
    installed here; a module that exists but needs another package does not count as absent."""
    import importlib

    from migration.codecheck.vocabulary import REMOVED

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        candidates = importlib.import_module("removed_api_candidates")
    finally:
        sys.path.pop(0)
    assert [name for name in REMOVED if not candidates.strictly_absent(name)] == []


def test_flax_names_are_said_to_be_removed_from_flax():
    found = check_source("import flax.optim\nfrom flax import nn\n")
    assert found and all("removed from Flax" in f.message for f in found)
