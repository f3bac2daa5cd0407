"""Serving plans (migration/planning/serving.py): a prefill chunk and the decode step compiled for a
GPU without the device, the engine's concurrency from the KV cache's pages and the step's token budget
(planning/capacity.py), per concurrency: KV-cache bytes compiled against arithmetic, peaks that grow
with it, decode time above the bandwidth limit, and refusals."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from migration.common import ConfigError
from migration.config.serving import ServeRequest, serve_request
from migration.hardware import GPU_SPECS
from migration.planning import capacity
from migration.planning.serving import _Planner, kv_cache_bytes, serve_plan, serve_row, serving_config


@pytest.fixture(scope="module")
def tiny_plan():
    return serve_plan(ServeRequest("llama", "tiny", "h100-sxm", prompt_len=32, gen_len=16, batches=(1, 4, 16)))


def test_the_compiled_kv_cache_is_the_arithmetic_one(tiny_plan):
    """A decode step reads each running sequence's cache up to the mean position it has reached (prompt
    + half the generation: 40 of 48); the pages held are at full length (48)."""
    assert tiny_plan["decode_context"] == 40 and tiny_plan["tokens_held_per_sequence"] == 48
    per_token = 2 * 2 * 2 * 16 * 2  # layers, kv heads, head size, k and v, bf16 bytes
    assert tiny_plan["kv_bytes_per_token"] == per_token
    for row in tiny_plan["rows"]:
        assert row["kv_cache_bytes"] == 48 * row["batch"] * per_token
        assert row["kv_cache_bytes_read"] == 40 * row["batch"] * per_token
        assert abs(row["kv_cache_bytes_compiled"] - row["kv_cache_bytes_read"]) <= 0.05 * row["kv_cache_bytes_read"]


def test_peaks_grow_with_the_concurrency_and_hold_weights_and_cache(tiny_plan):
    rows = {r["batch"]: r for r in tiny_plan["rows"]}
    assert rows[1]["predicted_peak_bytes"] < rows[4]["predicted_peak_bytes"] < rows[16]["predicted_peak_bytes"]
    for r in rows.values():
        assert r["predicted_peak_bytes"] >= r["weights_bytes"] + r["kv_cache_bytes"]
        assert r["decode_peak_bytes"] >= r["weights_bytes"] + r["kv_cache_bytes_read"]
        assert r["predicted_tpot_s"] >= r["decode_step_s"] >= r["bandwidth_limit_tpot_s"] > 0  # no step beats its reads
        # every step prefills the prompts of the requests its outputs finish: 32 prompt tokens per 16 generated
        assert r["prefill_tokens_per_step"] == pytest.approx(2 * r["batch"])
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["batch"] / r["predicted_tpot_s"])
        assert r["requests_per_s"] == pytest.approx(r["tokens_per_s_per_gpu"] / 16)


@pytest.mark.parametrize("target", ["l4", "a10g", "l40s"])
def test_the_concurrency_is_what_the_kv_pages_hold_beside_weights_and_workspace(target):
    """A budget of a few hundred tiny sequences on the inference cards teams rent: the concurrency is the
    memory left after the weights and the larger workspace over a sequence's full-length pages, and one
    sequence more does not fit."""
    fraction = 1.2e6 / GPU_SPECS[target].memory_bytes  # about 1.2 MB of the card
    req = ServeRequest("llama", "tiny", target, prompt_len=32, gen_len=32, memory_fraction=fraction)
    plan = serve_plan(req)
    assert plan["target"] == GPU_SPECS[target].name
    n, budget = plan["largest_batch"], int(GPU_SPECS[target].memory_bytes * fraction)
    assert n >= 4 and plan["bound_by"] == "kv_cache" and plan["compiled_batches"] <= 7
    assert all(r["fits"] == (r["predicted_peak_bytes"] <= budget) for r in plan["rows"])
    top = max(plan["rows"], key=lambda r: r["batch"])
    assert top["batch"] == n and top["fits"]
    planner = _Planner(req)
    chunk = planner.chunk()
    assert planner.peak(n + 1, chunk) > budget  # the next sequence's pages are over the budget


def test_the_step_budget_bounds_the_concurrency_when_prompts_dominate():
    """Long prompts, short generations: each step must prefill concurrency x 32 prompt tokens, so a
    256-token budget sustains 256 / 33 = 7 running sequences whatever the memory holds."""
    plan = serve_plan(ServeRequest("llama", "tiny", "h100-sxm", prompt_len=64, gen_len=2, chunk=256))
    assert plan["largest_batch"] == 7 and plan["bound_by"] == "token_budget"
    assert plan["concurrency_limits"]["kv_cache"] > 7


def test_the_fused_attention_is_planned_where_the_target_runs_it():
    req = ServeRequest("llama", "1b", "h100-sxm", prompt_len=1024, gen_len=256)
    assert serving_config(req, GPU_SPECS["h100-sxm"]).attention == "cudnn"
    assert serving_config(ServeRequest("llama", "1b", "v100-32gb", 1024, 256, precision="fp16"),
                          GPU_SPECS["v100-32gb"]).attention == "xla"


@pytest.mark.parametrize("values,field,words", [
    (dict(workload="transformer", preset="tiny", prompt_len=60, gen_len=10), "gen_len", "exceed the model's context"),
    (dict(workload="mlp", preset="tiny"), "workload", "has no decode path"),
    (dict(batches="0,4"), "batches", "from 1 to 4,096"),
    (dict(batches="1,two"), "batches", "comma-separated"),
    (dict(prompt_len=0), "prompt_len", "from 1"),
    (dict(precision="int4"), "precision", "int8"),
    (dict(workload="mlp", preset="tiny", precision="int8"), "workload", "has no decode path"),
    (dict(target="local"), "target", "h100-sxm"),
    (dict(gpus=4), "gpus", "kv heads 2 do not divide by 4 (GPU counts that do: 1, 2)"),
    (dict(gpus=16), "gpus", "8"),
    (dict(preset="70b"), "preset", "tiny"),
    (dict(preset="8b", prompt_len=130000, gen_len=2000), "gen_len", "context of 131,072 (its published context"),
    (dict(workload="transformer", preset="gpt2-small", model={"context": 4096}), "context", "learned positions"),
    (dict(preset="8b", model={"context": -1}), "context", "from 0"),
])
def test_refused_serving_requests_name_the_field(values, field, words):
    given = dict(workload="llama", preset="tiny", target="h100-sxm", prompt_len=16, gen_len=16) | values
    with pytest.raises(ConfigError) as info:
        serve_request(**given)
    assert info.value.field == field and words in str(info.value), str(info.value)


def test_a_checked_request_keeps_its_values():
    req = serve_request(workload="llama", preset="1b", target="l4", prompt_len="1024", gen_len=256, batches="16,1,4")
    assert (req.prompt_len, req.gen_len, req.batches, req.precision) == (1024, 256, (1, 4, 16), "bf16")


def test_kv_cache_arithmetic_for_llama_8b():
    cfg = serving_config(ServeRequest("llama", "8b", "h100-sxm", 1024, 256), GPU_SPECS["h100-sxm"])
    # 32 layers x 8 kv heads x 128 x 1,280 tokens x 2 (k, v) x 2 bytes = 167,772,160 bytes a sequence
    assert kv_cache_bytes(cfg, 1, 1280, 2) == 167_772_160


@pytest.mark.slow
def test_the_command_line_writes_one_row_per_batch_with_its_kv_cache_and_peak(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, "-m", "migration", "serve-plan", "--workload", "llama", "--preset", "tiny",
                           "--target", "l4", "--prompt-len", "32", "--gen-len", "16", "--batches", "1,8",
                           "--json", str(out), "--csv", str(tmp_path / "serve.csv")],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(out.read_text())
    assert {1, 8} <= {r["batch"] for r in plan["rows"]}
    assert all(r["kv_cache_bytes"] > 0 and r["predicted_peak_bytes"] > r["kv_cache_bytes"] for r in plan["rows"])
    assert plan["engine"].startswith("continuous batching with chunked prefill")
    assert "concurrency:" in proc.stdout and "running sequences" in proc.stdout and "Traceback" not in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "migration", "serve-plan", "--preset", "tiny", "--prompt-len", "60",
                          "--gen-len", "10"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "gen_len" in bad.stderr and "Traceback" not in bad.stderr


def test_int8_weights_are_planned_without_a_dequantised_copy():
    """Weight-only int8: the Linear weights take one byte each, and no program holds a bf16 copy of
    them (each layer's kernel is converted where its matmul reads it)."""
    medium = {"d_model": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "d_ff": 1536}
    rows = {}
    for p in ("bf16", "int8"):  # one row each (serve_plan would also size the concurrency)
        planner = _Planner(ServeRequest("llama", "tiny", "l4", prompt_len=32, gen_len=32, precision=p, model=medium))
        rows[p] = serve_row(planner, 4, planner.chunk())
    linear = 8 * (512 * 512 * 2 + 512 * 256 * 2 + 512 * 3072 + 1536 * 512)  # q, out, kv, up (gate+up), down
    assert rows["bf16"]["weights_bytes"] - rows["int8"]["weights_bytes"] == pytest.approx(linear, rel=0.02)
    assert rows["int8"]["kv_cache_bytes"] == rows["bf16"]["kv_cache_bytes"]  # the cache stays bf16
    for program in ("prefill_peak_bytes", "decode_peak_bytes"):
        extra = rows["int8"][program] - rows["int8"]["weights_bytes"]
        assert extra < 0.25 * 2 * linear, (program, extra)  # far below a bf16 copy of the Linear weights
        assert rows["int8"][program] < rows["bf16"][program]


@settings(max_examples=300, deadline=None)
@example(classes=[(1.0, 676, 916)], free=0.0, per_token=1000.0, chunk=1990)  # 1990 / (1 + 676/916) is 1145 exactly
@given(classes=st.lists(st.tuples(st.floats(0.01, 10), st.integers(1, 100_000), st.integers(1, 20_000)),
                        min_size=1, max_size=8),
       free=st.floats(0, 2e11), per_token=st.floats(1e3, 1e6), chunk=st.integers(16, 65536))
def test_the_engine_arithmetic_holds_for_any_mix(classes, free, per_token, chunk):
    """The running sequences of a class are in proportion to its share x generation; the pages a
    sequence holds lie between its shortest and longest full length; the concurrency's pages fit the
    memory and one more sequence's do not; the step budget holds the concurrency's decode and prefill."""
    total = sum(c[0] for c in classes)
    mix = tuple(capacity.RequestClass(share / total, prompt, gen) for share, prompt, gen in classes)
    fig = capacity.mix_figures(mix)
    lengths = [c.prompt + c.gen for c in mix]
    assert min(lengths) * (1 - 1e-9) <= fig.tokens_held <= max(lengths) * (1 + 1e-9)
    assert fig.context_read <= fig.tokens_held and fig.longest == max(lengths)
    n = capacity.kv_bound_concurrency(free, per_token, fig.tokens_held)
    assert n * per_token * fig.tokens_held <= free * (1 + 1e-12) and free < (n + 1) * per_token * fig.tokens_held
    m = capacity.budget_bound_concurrency(chunk, fig.prompt_per_output)
    assert m * (1 + fig.prompt_per_output) <= chunk * (1 + 1e-12) and chunk < (m + 1) * (1 + fig.prompt_per_output)
    if m:
        state = capacity.steady_state(m, 0.01, 1e-5, 0.0, fig, chunk)
        assert state.prefill_tokens_per_step + m <= chunk * (1 + 1e-9)
        assert state.output_tokens_per_s == pytest.approx(m / state.step_s)
        assert state.ttft_s >= fig.mean_prompt * 1e-5


def test_an_fp8_kv_cache_on_blackwell_halves_the_cache_and_compiles_as_one():
    """On a B200, the same rows with the cache in e4m3: the compiled programs' donated cache is half of bf16's,
    and so is the arithmetic; the decode step reads fewer bytes."""
    base = dict(workload="llama", preset="tiny", target="b200", prompt_len=32, gen_len=16, batches=(4, 16))
    bf16, fp8 = (serve_plan(serve_request(**base, kv_cache=kv)) for kv in ("auto", "fp8"))
    assert (bf16["kv_cache"], fp8["kv_cache"]) == ("bfloat16", "float8_e4m3fn")
    fp8_rows = {r["batch"]: r for r in fp8["rows"]}
    for a, b in ((r, fp8_rows[r["batch"]]) for r in bf16["rows"] if r["batch"] in (4, 16)):
        assert b["kv_cache_bytes"] * 2 == a["kv_cache_bytes"]
        assert abs(b["kv_cache_bytes_compiled"] - b["kv_cache_bytes_read"]) <= 0.05 * b["kv_cache_bytes_read"]
        assert b["decode_peak_bytes"] < a["decode_peak_bytes"]
    with pytest.raises(ConfigError, match="kv_cache: must be one of auto, fp8"):
        serve_request(**base, kv_cache="int4")


def test_decoding_from_an_fp8_cache_keeps_the_greedy_tokens_close():
    """The model's own decode path with its cache in e4m3 (unit scale, clipped) against bf16: the logits of
    the next token stay close, measured on this machine's backend."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from workloads.decoding import empty_cache, serving_decoder

    cfg = serving_config(ServeRequest("llama", "tiny", "h100-sxm", 16, 8), GPU_SPECS["h100-sxm"])
    cfg = __import__("dataclasses").replace(cfg, attention="xla")
    model = serving_decoder(cfg, "bf16", nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    last = jnp.full((2,), 15)
    out = {}
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        cache = empty_cache(cfg, 2, 24, dtype)
        _, cache = model.prefill(tokens, last, cache)
        logits, _ = model.extend(tokens[:, -1:], jnp.full((2,), 16), cache)
        out[dtype] = logits.astype(jnp.float32)
    gap = float(jnp.abs(out[jnp.float8_e4m3fn] - out[jnp.bfloat16]).max() / jnp.abs(out[jnp.bfloat16]).max())
    assert 0 < gap < 0.1


def test_presets_serve_their_published_context_and_plan_long_prompts():
    """Llama 3.1 8B trains here at 2,048 tokens a sequence and serves 131,072 (rotary positions scaled
    8x from 8,192); GPT-2's learned positions serve their table's 1,024."""
    long = serve_request(workload="llama", preset="8b", target="h100-sxm", prompt_len=32768, gen_len=1024)
    assert long.prompt_len == 32768
    serve_request(workload="llama", preset="8b", target="h200", prompt_len=126976, gen_len=4096)
    cfg = serving_config(long, GPU_SPECS["h100-sxm"])
    assert (cfg.seq_len, cfg.max_context, cfg.rope_scaling, cfg.rope_original_context) == (2048, 131072, 8.0, 8192)
    assert serving_config(ServeRequest("transformer", "gpt2-small", "l4", 512, 512), GPU_SPECS["l4"]).max_context == 1024
    custom = serve_request(workload="llama", preset="8b", target="h100-sxm", prompt_len=8192, gen_len=8,
                           model={"n_layers": 2, "context": 16384})
    assert serving_config(custom, GPU_SPECS["h100-sxm"]).max_context == 16384


@pytest.mark.slow
@pytest.mark.parametrize("preset,dims", [("8b", ["--layers", "4"]), ("1b", ["--layers", "2", "--vocab", "8192"])])
def test_the_decode_step_reads_the_weights_and_cache_once_at_batch_1_and_at_the_largest_batch(tmp_path, preset, dims):
    """The compiled decode step's kernels move at most 1.2x what it must read (the weights it reads
    whole and the cache it reads), at 1 and at the most running sequences the plan allows: each layer's cache is its
    own array in the layout the attention reads in place, the serving processes' XLA flags keep
    the weights uncopied, and one-row products stay GEMMs (a 1B model's 2,048 x 2,048 projections were
    rewritten as a multiply written out whole and a reduction: 1.27x at batch 1). Through the command,
    whose process sets those flags, on Llama 3.1 8B's and 3.2 1B's layer dimensions at a few layers (the
    ratio is per layer and head: the depth changes it little; 1B's vocabulary cut so that its head does not
    hide the layers)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "migration", "serve-plan", "--preset", preset, *dims,
                           "--target", "h100-sxm", "--prompt-len", "1024", "--gen-len", "256", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(out.read_text())
    rows = {r["batch"]: r for r in plan["rows"]}
    assert plan["largest_batch"] > 256 and {1, plan["largest_batch"]} <= set(rows)
    for batch in (1, plan["largest_batch"]):
        row = rows[batch]
        assert row["decode_bytes"] <= 1.2 * (row["weights_read_bytes"] + row["kv_cache_bytes_read"]), (batch, row)
        assert row["decode_bytes_over_needed"] == pytest.approx(
            row["decode_bytes"] / (row["weights_read_bytes"] + row["kv_cache_bytes_read"]))
    # the untied input embedding (128,256 x 4,096 in bf16) is gathered, not read whole; 1B's is tied: read whole
    gathered = 128256 * 4096 * 2 if preset == "8b" else 0
    assert rows[1]["weights_bytes"] - rows[1]["weights_read_bytes"] == gathered


def test_serving_commands_take_the_training_commands_model_dimensions(tmp_path):
    """`--layers` and the other dimension flags give serve-plan and serve-run a model of any dimensions
    (over the preset's, or the family's custom base); beside --checkpoint, which names its own model,
    they are refused in one line."""
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "migration", "serve-plan", "--preset", "tiny", "--layers", "3",
                         "--d-model", "96", "--heads", "6", "--kv-heads", "2", "--target", "l4", "--prompt-len", "8",
                         "--gen-len", "8", "--batches", "2"],
                        capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "n_layers=3" in ok.stdout and "d_model=96" in ok.stdout, ok.stdout[:500]
    for command in (["serve-plan", "--prompt-len", "8", "--gen-len", "8"], ["serve-run"]):
        bad = subprocess.run([sys.executable, "-m", "migration", *command, "--checkpoint", str(tmp_path),
                              "--layers", "3"], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "--layers cannot be given with --checkpoint" in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr


def test_a_queued_plan_reaches_its_worker_with_its_mix_budget_and_model():
    """The arguments a serving job hands its worker check back to the same request (mix, token budget,
    model dimensions), and a run's model dimensions travel too."""
    from migration.config.serving import serve_run_request
    from migration.service.jobs import serve_plan_arguments, serve_run_arguments

    for kw in (dict(mix="3*1000:200, 1*30000:1000", chunk=512, model={"n_layers": 4}),
               dict(prompt_len=4096, gen_len=300, chunk=8192)):
        req = serve_request(workload="llama", preset="8b", target="h200", **kw)
        assert serve_request(**serve_plan_arguments(req)) == req
    assert serve_request(workload="llama", preset="8b", target="h200", mix="3*1000:200,1*30000:1000").classes == \
        ((0.75, 1000, 200), (0.25, 30000, 1000))
    run = serve_run_request(workload="llama", preset="tiny", model={"n_layers": 3}, batches="2")
    assert serve_run_request(**serve_run_arguments(run)) == run and run.model == {"n_layers": 3}
    with pytest.raises(ConfigError, match="mix: give the requests as a mix or as one prompt"):
        serve_request(workload="llama", preset="8b", target="h200", mix="10:10", prompt_len=5)


@pytest.mark.parametrize("command", ["serve-plan", "serve-run"])
def test_serving_commands_refuse_code_they_cannot_read_in_one_line(tmp_path, command):
    """`--code` names the user's serving script: a missing file, a folder or bytes that are not text are
    refused in one line naming the flag, before anything compiles or runs."""
    import subprocess
    import sys
    from pathlib import Path

    binary = tmp_path / "serve.py"
    binary.write_bytes(b"\xff\xfe\x00import jax\n")
    lengths = (["--target", "l4", "--prompt-len", "8", "--gen-len", "8"] if command == "serve-plan"
               else ["--requests", "1", "--batches", "1", "--prompt-max", "8", "--gen-max", "4"])
    for code in (tmp_path / "missing.py", tmp_path, binary)[:3 if command == "serve-plan" else 1]:  # one path each
        proc = subprocess.run([sys.executable, "-m", "migration", command, "--preset", "tiny", *lengths,
                               "--code", str(code)], capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parent.parent)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --code: "), (code, proc.stderr)
        assert "Traceback" not in proc.stderr and proc.stdout == ""
