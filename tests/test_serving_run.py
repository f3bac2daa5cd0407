"""Measured serving on this machine (migration/running/serving.py): a stream of 50 mixed-length
requests on the CPU backend for both decoder families, with no compile after the warm-up, and the
tokens a batch generates equal to greedy decoding by the full forward pass, request by request."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from migration.common import ConfigError
from migration.config.serving import ServeRunRequest, serve_run_request
from migration.running.serving import (LOGIT_TOLERANCE, Server, bucket, check_memory, logits_check, memory_floor,
                                       serve_run)
from workloads.base import no_wrap
from workloads.decoding import quantize_kernel, serving_decoder
from workloads.decoders import LLAMA, WORKLOAD
from workloads.transformer import Decoder


@pytest.mark.parametrize("workload", ["llama", "transformer"])
def test_fifty_mixed_requests_compile_nothing_after_the_warm_up(workload):
    result = serve_run(ServeRunRequest(workload, "tiny", requests=50, batches=(4, 1), prompt_range=(3, 40),
                                       gen_range=(2, 20)))
    assert result["recompiles"] == 0 and result["backend"] == "cpu" and result["logits_check"] is None
    assert [row["batch"] for row in result["rows"]] == [1, 4]  # ascending: the peak so far is the largest's
    for row, batches in zip(result["rows"], (50, 13)):
        assert row["recompiles"] == 0
        assert row["programs_compiled"] == len(result["buckets"]) + 1  # a prefill per bucket, one decode step
        assert row["requests"] == 50 and row["batches"] == batches
        assert 0 < row["ttft_p50_s"] <= row["ttft_p90_s"] and 0 < row["tpot_p50_s"] <= row["tpot_p90_s"]
        assert row["tokens_per_s"] > 0 and row["peak_memory_bytes"] > 0


def test_buckets_are_powers_of_two_from_sixteen_up_to_the_cache():
    assert [bucket(n, 64) for n in (1, 16, 17, 33, 64, 70)] == [16, 16, 32, 64, 64, 64]


@pytest.mark.parametrize("cfg", [LLAMA.presets["tiny"], WORKLOAD.presets["tiny"]], ids=["llama", "gpt2"])
def test_a_batch_generates_what_greedy_decoding_by_the_full_forward_generates(cfg):
    server = Server(cfg, "fp32", batch=3, max_len=48, temperature=0.0, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 11, 2)]
    gens = [6, 3, 9]
    out = server.serve(prompts, gens)["tokens"]
    model = Decoder(cfg, dtype=jnp.float32, block_wrap=no_wrap, rngs=nnx.Rngs(3))
    for prompt, gen, got in zip(prompts, gens, out):
        seq = list(prompt)
        for _ in range(gen):
            seq.append(int(jnp.argmax(model(jnp.asarray([seq]))[0, -1])))
        assert got == seq[len(prompt):]


@pytest.mark.parametrize("values,field", [
    (dict(workload="cnn"), "workload"), (dict(batches="0"), "batches"), (dict(batches=""), "batches"),
    (dict(batches="1,2,3,4,5,6,7"), "batches"), (dict(batches="5000"), "batches"), (dict(requests=5000), "requests"),
    (dict(prompt_min=30, prompt_max=10), "prompt_min"), (dict(prompt_max=50, gen_max=20), "gen_max"),
    (dict(workload="mlp", precision="int8"), "workload"), (dict(precision="int4"), "precision"),
    (dict(temperature=-1), "temperature"),
])
def test_refused_serving_runs_name_the_field(values, field):
    with pytest.raises(ConfigError) as info:
        serve_run_request(**(dict(workload="llama", preset="tiny", prompt_max=32, gen_max=16) | values))
    assert info.value.field == field, str(info.value)


@pytest.mark.slow
def test_the_command_line_measures_a_stream_and_says_where(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "migration", "serve-run", "--workload", "llama", "--preset", "tiny",
                           "--requests", "12", "--batches", "3", "--json", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    row, = result["rows"]
    assert result["recompiles"] == 0 and row["requests"] == 12 and row["peak_memory_bytes"] > 0
    assert "CPU figures, not a GPU's" in proc.stdout and "compiles after the warm-up (should be 0)" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "migration", "serve-run", "--preset", "tiny", "--batches", "0"],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert bad.returncode == 2 and "batches" in bad.stderr and "Traceback" not in bad.stderr


def test_a_json_path_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", "migration", "serve-run", "--preset", "tiny", "--requests", "2",
                           "--json", str(tmp_path / "no" / "such" / "folder" / "r.json")],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 2 and "could not be written" in proc.stderr and "Traceback" not in proc.stderr


def test_int8_weights_keep_the_logits_within_the_stated_tolerance_and_the_check_can_fail():
    cfg = LLAMA.presets["tiny"]
    for precision in ("bf16", "fp16", "int8"):
        check = logits_check(cfg, precision, None, seed=1)
        assert check["within"] and check["rms_ratio"] <= LOGIT_TOLERANCE[precision], check
        assert check["rms_ratio"] > 0  # a lower precision changes something
    # Layers that matter (weights x10) and one outlier per output column, which leaves the other
    # weights a few int8 steps: bf16 stays within, int8 must not.
    model = Decoder(cfg, dtype=jnp.float32, block_wrap=no_wrap, rngs=nnx.Rngs(1))
    blocks = model.blocks
    for linear in (blocks.attn.q, blocks.attn.kv, blocks.attn.out, blocks.mlp.up, blocks.mlp.down):
        linear.kernel[...] = (linear.kernel[...] * 10).at[:, 0, :].set(40.0)
    assert logits_check(cfg, "bf16", nnx.state(model), seed=1)["within"]
    bad = logits_check(cfg, "int8", nnx.state(model), seed=1)
    assert not bad["within"] and bad["rms_ratio"] > LOGIT_TOLERANCE["int8"], bad


def test_int8_kernels_round_trip_within_half_a_step_and_halve_the_weights():
    kernel = jax.random.normal(jax.random.key(0), (3, 64, 32)) * jnp.arange(1, 33)  # columns of growing scale
    q, scale = quantize_kernel(kernel)
    assert q.dtype == jnp.int8 and scale.shape == (3, 32)
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32) * scale[:, None, :] - kernel) / scale[:, None, :])) <= 0.5
    cfg = LLAMA.presets["1b"]
    size = lambda p: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(  # noqa: E731
        nnx.state(nnx.eval_shape(lambda: serving_decoder(cfg, p, nnx.Rngs(0))))))
    bf16, int8 = size("bf16"), size("int8")
    linears = bf16 - 2 * cfg.vocab_size * cfg.d_model - 2 * (2 * cfg.n_layers + 1) * cfg.d_model  # tied 1B: no head
    assert int8 < bf16 and abs((bf16 - int8) - linears / 2) / linears < 0.01  # the Linear weights take half


def test_int8_serving_decodes_with_no_compile_after_the_warm_up():
    result = serve_run(ServeRunRequest("llama", "tiny", precision="int8", requests=8, batches=(2,)))
    assert result["recompiles"] == 0 and result["logits_check"]["within"]
    assert result["rows"][0]["generated_tokens"] > 0


def test_a_run_with_an_fp8_kv_cache_serves_from_e4m3_and_reports_how_many_tokens_agree():
    req = serve_run_request(workload="llama", preset="tiny", precision="bf16", requests=8, batches="4",
                            kv_cache="fp8")
    assert req.kv_cache == "fp8"
    cfg = LLAMA.config("tiny", {})
    assert Server(cfg, "bf16", 2, 32, 0.0, 0, kv_cache="fp8").dtype == jnp.float8_e4m3fn
    result = serve_run(req)
    check = result["kv_cache_check"]
    assert check["against"] == "bfloat16" and check["tokens"] > 0 and 0.5 <= check["token_agreement"] <= 1.0
    assert result["recompiles"] == 0
    assert serve_run(serve_run_request(workload="llama", preset="tiny", requests=4, batches="4"))["kv_cache_check"] is None
    with pytest.raises(ConfigError, match="kv_cache"):
        serve_run_request(workload="llama", preset="tiny", kv_cache="fp4")


def test_a_run_larger_than_the_machine_is_refused_from_arithmetic():
    """Llama 3.1 8B in bf16, 4,096 sequences of 8,192 + 1,024 tokens: 8,030,261,248 parameters x 2 bytes of
    weights, and 2 (keys, values) x 32 layers x 8 kv heads x 128 x 9,216 positions x 4,096 x 2 bytes =
    4,947.8 GB of cache: refused naming `batches` before anything is allocated; the tiny model's run is not."""
    req = serve_run_request(workload="llama", preset="8b", precision="bf16", batches="4096", prompt_max=8192,
                            gen_max=1024)
    assert memory_floor(req) == (8_030_261_248 * 2, 2 * 32 * 8 * 128 * 9216 * 4096 * 2)
    with pytest.raises(ConfigError) as err:
        check_memory(req, 0.9)
    assert str(err.value).startswith("batches: batch 4,096 at 8,192 + 1,024 tokens needs 16.06 GB of weights and "
                                     "4,947.80 GB of KV cache")
    int8 = serve_run_request(workload="llama", preset="8b", precision="int8", batches="1", prompt_max=16, gen_max=16)
    assert memory_floor(int8)[0] == 8_030_261_248 and memory_floor(int8)[1] == 2 * 32 * 8 * 128 * 32 * 2
    check_memory(serve_run_request(workload="llama", preset="tiny", batches="64"), 0.9)  # fits: no error
