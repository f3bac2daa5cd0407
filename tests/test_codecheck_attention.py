"""ATTN001 (attention that stores the scores) and the planner reading it: `plan --code FILE` plans with XLA's
attention where the code check finds it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from migration.codecheck import check_source

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests/fixtures/codecheck/tpu2022_attention_by_hand.py"


def rules(text: str) -> list[str]:
    return [f.rule for f in check_source(text) if f.rule == "ATTN001"]


@pytest.mark.parametrize("body", [
    "w = jax.nn.softmax(q @ k.T)",
    "w = jax.nn.softmax(jnp.matmul(q, jnp.swapaxes(k, -1, -2)) / 8)",
    "s = jnp.einsum('bhqd,bhkd->bhqk', q, k)\n    w = jax.nn.softmax(s)",
    "s = jnp.einsum('bqhd,bkhd->bhqk', q, k)\n    s = s * 0.1\n    w = jax.nn.softmax(s)",
    "w = jax.nn.dot_product_attention(q, k, v, implementation='xla')",
    "w = nn.dot_product_attention(q, k, v)",
])
def test_attention_that_stores_the_scores_is_found(body):
    text = f"import jax\nimport jax.numpy as jnp\nfrom flax import linen as nn\n\ndef f(q, k, v):\n    {body}\n    return w\n"
    assert rules(text) == ["ATTN001"]


@pytest.mark.parametrize("body", [
    "w = jax.nn.softmax(q @ k)",  # a layer's product, no transposed keys
    "w = jax.nn.softmax(jnp.einsum('btd,dv->btv', q, k))",  # a projection then a softmax: a classifier
    "w = jax.nn.dot_product_attention(q, k, v, implementation='cudnn')",
    "w = jax.nn.log_softmax(q)",
    "s = q @ k.T\n    w = s",  # scores but no softmax over them here
])
def test_other_softmaxes_and_the_fused_kernel_are_not(body):
    text = f"import jax\nimport jax.numpy as jnp\n\ndef f(q, k, v):\n    {body}\n    return w\n"
    assert rules(text) == []


@pytest.mark.slow
def test_plan_reads_the_code_and_plans_with_xla_attention(tmp_path):
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "migration", "plan", "--workload", "transformer", "--preset", "tiny",
                           "--target", "h100-sxm", "--gpus", "1", "--global-batch", "16", "--no-tpu-compile", "--quiet",
                           "--code", str(FIXTURE), "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "found attention that stores the scores at" in proc.stdout and "ATTN001" in proc.stdout
    plan = json.loads(out.read_text())
    assert plan["model"]["attention"] == "xla"


def test_plan_with_unreadable_code_is_refused_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "migration", "plan", "--code", str(tmp_path / "missing.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --code:") and "missing.py" in proc.stderr and "Traceback" not in proc.stderr
