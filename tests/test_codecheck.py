"""The code check: every rule has a positive and a negative example; the TPU-era script is flagged;
nothing is ever executed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from migration.codecheck import RULES, CodeCheckError, check_files, check_source

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
