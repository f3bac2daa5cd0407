"""Measured serving on this machine (migration/running/serving.py): a stream of 50 mixed-length
requests on the CPU backend for both decoder families, with no compile after the warm-up, and the
tokens a batch generates equal to greedy decoding by the full forward pass, request by request."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from migration.config.limits import ConfigError
from migration.config.serving import ServeRunRequest, serve_run_request
from migration.running.serving import Server, bucket, serve_run
from workloads.base import no_wrap
from workloads.transformer import LLAMA, WORKLOAD, Decoder


@pytest.mark.parametrize("workload", ["llama", "transformer"])
def test_fifty_mixed_requests_compile_nothing_after_the_warm_up(workload):
    result = serve_run(ServeRunRequest(workload, "tiny", requests=50, batch=4, prompt_range=(3, 40),
                                       gen_range=(2, 20)))
    assert result["recompiles"] == 0
    assert result["programs_compiled"] == len(result["buckets"]) + 1  # a prefill per bucket, one decode step
    assert result["requests"] == 50 and result["batches"] == 13
    assert 0 < result["ttft_p50_s"] <= result["ttft_p90_s"] and 0 < result["tpot_p50_s"] <= result["tpot_p90_s"]
    assert result["tokens_per_s"] > 0 and result["backend"] == "cpu"


def test_buckets_are_powers_of_two_from_sixteen_up_to_the_cache():
    assert [bucket(n, 64) for n in (1, 16, 17, 33, 64, 70)] == [16, 16, 32, 64, 64, 64]


@pytest.mark.parametrize("cfg", [LLAMA.presets["tiny"], WORKLOAD.presets["tiny"]], ids=["llama", "gpt2"])
def test_a_batch_generates_what_greedy_decoding_by_the_full_forward_generates(cfg):
    server = Server(cfg, jnp.float32, batch=3, max_len=48, temperature=0.0, seed=3)
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
    (dict(workload="cnn"), "workload"), (dict(batch=0), "batch"), (dict(requests=5000), "requests"),
    (dict(prompt_min=30, prompt_max=10), "prompt_min"), (dict(prompt_max=50, gen_max=20), "gen_max"),
    (dict(precision="int8"), "precision"), (dict(temperature=-1), "temperature"),
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
                           "--requests", "12", "--batch", "3", "--json", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["recompiles"] == 0 and result["requests"] == 12 and result["peak_memory_bytes"] > 0
    assert "CPU figures, not a GPU's" in proc.stdout and "compiles after the warm-up: 0" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "migration", "serve-run", "--preset", "tiny", "--batch", "0"],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert bad.returncode == 2 and "batch" in bad.stderr and "Traceback" not in bad.stderr


def test_a_json_path_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", "migration", "serve-run", "--preset", "tiny", "--requests", "2",
                           "--json", str(tmp_path / "no" / "such" / "folder" / "r.json")],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 2 and "could not be written" in proc.stderr and "Traceback" not in proc.stderr
