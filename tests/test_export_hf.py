"""A llama-family model exported to Hugging Face's layout (migration/running/export.py) and loaded by
transformers' own LlamaForCausalLM on the CPU: the same token ids give the same logits at every
position as the model's forward (real JAX, real torch, no stand-ins).

Tolerances, as the largest absolute difference over the largest absolute logit of the model (every
position of every row): an fp32 export within 1e-4 (measured 2e-6 to 6e-6: float32 rounding of two
implementations); a bf16 export that HF computes in bf16 within 0.1, and within 0.03 as the RMS of
the difference over the RMS of the logits (measured 0.036 to 0.067 and 0.020 to 0.024 over nine
models; the model's own bf16 forward is as far from its fp32 one: 0.030 to 0.062 and about 0.020).
Weights are drawn larger than the init's (unit-variance activations, sharper attention) so that a
wrong rotary convention, a swapped fusion or a wrong head grouping moves the logits far past these
(tested: by more than 100 times the fp32 tolerance)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never ask the hub
try:
    import torch
    import transformers
except ImportError as exc:
    message = f"needs {exc.name}: pip install -r requirements-export.txt (torch, transformers, safetensors)"
    if os.environ.get("CI"):
        raise ImportError(f"CI runs the Hugging Face export test: {message}") from exc
    pytest.skip(message, allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from migration.cli.commands import main  # noqa: E402
from migration.common import ConfigError  # noqa: E402
from migration.config.requests import CHECKPOINT_META_FILE  # noqa: E402
from migration.running import checkpoint  # noqa: E402
from migration.running.export import (  # noqa: E402
    INDEX_FILE,
    export_checkpoint,
    export_hf,
    hf_config,
    hf_tensors,
    verify_export,
)
from migration.step.train import TrainProgram, step_parts  # noqa: E402
from tests.conftest import TRAINED_LLAMA  # noqa: E402
from workloads import get_workload  # noqa: E402
from workloads.base import no_wrap  # noqa: E402
from workloads.transformer import Decoder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FP32_TOLERANCE = 1e-4
BF16_TOLERANCE = 0.1
BF16_RMS_TOLERANCE = 0.03
# tiny: 4 query heads over 2 kv heads, tied embeddings, theta 10,000. The others: untied with biases
# and one kv head; Llama 3's rotary scaling, active within the 64 positions (original context 16).
MODELS = {
    "tiny-tied-gqa": {},
    "untied-bias-one-kv-head": {"tied_embeddings": False, "bias": True, "n_kv_heads": 1},
    "llama3-rope-scaling": {"rope_scaling": 8.0, "rope_original_context": 16, "rope_theta": 500000.0,
                            "tied_embeddings": False},
}


def llama(overrides: dict, seed: int = 0) -> tuple[Decoder, object]:
    """A llama-family Decoder computing in fp32, its weights redrawn: kernels with variance
    1/fan-in (queries and keys twice that scale, for sharp attention), the embedding unit normal,
    norm scales 1 +- 0.3, biases 0.3 normal."""
    cfg = get_workload("llama").config("tiny", overrides)
    model = Decoder(cfg, dtype=jnp.float32, block_wrap=no_wrap, rngs=nnx.Rngs(seed))
    pure = nnx.state(model, nnx.Param).to_pure_dict()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(pure)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    drawn = []
    for (path, leaf), key in zip(leaves, keys):
        name = jax.tree_util.keystr(path)
        z = jax.random.normal(key, leaf.shape, jnp.float32)
        if "kernel" in name:
            z = z / np.sqrt(leaf.shape[-2]) * (2.0 if "'q'" in name or "'kv'" in name else 1.0)
        elif "scale" in name:
            z = 1 + 0.3 * z
        elif "bias" in name:
            z = 0.3 * z
        drawn.append(z)
    nnx.update(model, jax.tree.unflatten(treedef, drawn))
    return model, cfg


TOKENS = np.random.default_rng(0).integers(0, 256, (3, 64))  # 3 rows of the whole context (64 positions)


def ours(model: Decoder, tokens: np.ndarray = TOKENS) -> np.ndarray:
    return np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens, jnp.int32)), np.float32)


def theirs(folder: Path, dtype=torch.float32, tokens: np.ndarray = TOKENS) -> np.ndarray:
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits.float().numpy()


def relative_difference(expected: np.ndarray, got: np.ndarray) -> float:
    """The largest absolute difference over the largest absolute logit, every position of every row."""
    assert expected.shape == got.shape
    return float(np.abs(expected - got).max() / np.abs(expected).max())


def rms_ratio(expected: np.ndarray, got: np.ndarray) -> float:
    """The RMS of the difference over the RMS of the logits."""
    return float(np.sqrt(np.mean((expected - got) ** 2) / np.mean(expected ** 2)))


@pytest.mark.parametrize("name", list(MODELS))
def test_an_fp32_export_gives_the_models_logits_at_every_position(name, tmp_path):
    model, cfg = llama(MODELS[name])
    summary = export_hf(model, cfg, tmp_path, dtype="fp32")
    assert summary["files"] == ["config.json", "model.safetensors"] and summary["dtype"] == "fp32"
    assert summary["parameters"] == get_workload("llama").param_count(cfg)
    assert summary["bytes"] == sum((tmp_path / f).stat().st_size for f in summary["files"])
    assert len({(tmp_path / f).stat().st_mode for f in summary["files"]}) == 1  # the umask's, the weights too
    written = load_file(tmp_path / "model.safetensors")
    assert len(written) == summary["tensors"] and ("lm_head.weight" in written) != cfg.tied_embeddings
    assert all(t.dtype == np.float32 for t in written.values())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_scaling"] is None if cfg.rope_scaling == 1 else config["rope_scaling"]["rope_type"] == "llama3"
    diff = relative_difference(ours(model), theirs(tmp_path))
    assert diff <= FP32_TOLERANCE, f"{name}: {diff:.2e}"


def test_the_config_says_what_the_model_computes():
    cfg = get_workload("llama").config("8b", {})
    config = hf_config(cfg)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (4096, 14336, 32)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 8, 128)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (128256, 131072)  # the published context
    assert (config["rms_norm_eps"], config["rope_theta"], config["hidden_act"]) == (1e-5, 500000.0, "silu")
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert not config["tie_word_embeddings"] and not config["attention_bias"] and not config["mlp_bias"]
    assert config["torch_dtype"] == "bfloat16" and hf_config(cfg, "fp32")["torch_dtype"] == "float32"
    tiny = hf_config(get_workload("llama").config("tiny", {}))
    assert tiny["rope_scaling"] is None and tiny["rope_theta"] == 10000.0 and tiny["tie_word_embeddings"]
    # transformers reads it as written, Llama 3's frequency scaling included
    loaded = transformers.LlamaConfig(**config)
    assert loaded.rope_parameters["rope_type"] == "llama3" and loaded.rope_parameters["factor"] == 8.0
    assert loaded.rope_parameters["rope_theta"] == 500000.0 and loaded.num_key_value_heads == 8


def test_a_bf16_export_loads_and_matches_within_the_looser_tolerance(tmp_path):
    model, cfg = llama(MODELS["untied-bias-one-kv-head"], seed=1)
    summary = export_hf(model, cfg, tmp_path)  # bf16 is the default
    assert summary["dtype"] == "bf16"
    assert all(str(t.dtype) == "bfloat16" for t in load_file(tmp_path / "model.safetensors").values())
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    expected, got = ours(model), theirs(tmp_path, torch.bfloat16)
    diff, rms = relative_difference(expected, got), rms_ratio(expected, got)
    assert diff <= BF16_TOLERANCE and rms <= BF16_RMS_TOLERANCE, f"{diff:.3f}, RMS {rms:.4f}"
    assert diff > FP32_TOLERANCE  # it really is bf16
    # fp16 is written too; HF computing in float32 on its rounded weights is closer still
    export_hf(model, cfg, tmp_path, dtype="fp16")
    assert all(t.dtype == np.float16 for t in load_file(tmp_path / "model.safetensors").values())
    assert FP32_TOLERANCE < relative_difference(expected, theirs(tmp_path)) <= diff


def test_shards_above_the_limit_are_written_with_an_index_as_hf_writes_them(tmp_path):
    model, cfg = llama(MODELS["tiny-tied-gqa"])
    summary = export_hf(model, cfg, tmp_path, dtype="fp32", max_shard_bytes=100_000)
    shards = [f for f in summary["files"] if f.endswith(".safetensors")]
    assert len(shards) == 4 and shards[0] == "model-00001-of-00004.safetensors" and INDEX_FILE in summary["files"]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == shards and len(index["weight_map"]) == summary["tensors"]
    assert index["metadata"]["total_size"] == 4 * summary["parameters"]
    assert len({(tmp_path / f).stat().st_mode for f in summary["files"]}) == 1
    assert relative_difference(ours(model), theirs(tmp_path)) <= FP32_TOLERANCE
    # a single-file export replaces it whole (no shard left over for a loader to find)
    assert export_hf(model, cfg, tmp_path, dtype="fp32")["files"] == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def hf_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's convert_llama_weights_to_hf permutation of q/k rows (interleaved pairs -> halves)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, w.shape[1]).transpose(0, 2, 1, 3).reshape(w.shape)


@pytest.mark.parametrize("mistake", ["interleaved-rotary", "values-first", "up-before-gate"])
def test_the_comparison_catches_a_wrong_mapping(mistake, tmp_path):
    """The tolerance is tight enough to tell the right mapping from plausible wrong ones: the rotary
    permutation Meta's checkpoints need (these must not get it), the fused kv and gate/up halves
    swapped."""
    model, cfg = llama(MODELS["tiny-tied-gqa"])
    export_hf(model, cfg, tmp_path, dtype="fp32")
    tensors = hf_tensors(cfg, model)
    for i in range(cfg.n_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        if mistake == "interleaved-rotary":
            tensors[f"{attn}.q_proj.weight"] = hf_permute(tensors[f"{attn}.q_proj.weight"], cfg.n_heads)
            tensors[f"{attn}.k_proj.weight"] = hf_permute(tensors[f"{attn}.k_proj.weight"], cfg.n_kv_heads)
        elif mistake == "values-first":
            k, v = tensors[f"{attn}.k_proj.weight"], tensors[f"{attn}.v_proj.weight"]
            tensors[f"{attn}.k_proj.weight"], tensors[f"{attn}.v_proj.weight"] = v, k
        else:
            g, u = tensors[f"{mlp}.gate_proj.weight"], tensors[f"{mlp}.up_proj.weight"]
            tensors[f"{mlp}.gate_proj.weight"], tensors[f"{mlp}.up_proj.weight"] = u, g
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    assert relative_difference(ours(model), theirs(tmp_path)) > 100 * FP32_TOLERANCE


def test_the_gpt2_layout_is_refused_naming_the_field(tmp_path):
    gpt2 = get_workload("transformer").config("tiny", {})
    with pytest.raises(ConfigError) as info:
        hf_config(gpt2)
    assert info.value.field == "norm"
    assert str(info.value).startswith("norm: the model has norm layernorm, mlp gelu, positions learned; ")
    assert "needs norm rmsnorm, mlp swiglu, positions rope" in str(info.value)
    model = Decoder(gpt2, dtype=jnp.float32, block_wrap=no_wrap, rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="^norm: "):
        export_hf(model, gpt2, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written
    with pytest.raises(ConfigError, match="^positions: the model has positions learned"):
        hf_config(get_workload("llama").config("tiny", {"positions": "learned"}))
    with pytest.raises(ConfigError, match="^workload: the model is MLPConfig, not a decoder"):
        hf_config(get_workload("mlp").config("tiny", {}))


def test_parameters_of_another_config_and_bad_arguments_are_refused(tmp_path):
    model, cfg = llama({})
    other = get_workload("llama").config("tiny", {"d_ff": 96})
    with pytest.raises(ConfigError, match=r"^model: the parameters are not those of the config: blocks\.mlp\.down"):
        hf_tensors(other, model)
    with pytest.raises(ConfigError, match="^dtype: must be one of bf16, fp16, fp32; got 'int8'"):
        export_hf(model, cfg, tmp_path, dtype="int8")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"^out: .* holds other files \(notes.txt\)"):
        export_hf(model, cfg, tmp_path)
    with pytest.raises(ConfigError, match="^out: .* is a file"):
        export_hf(model, cfg, tmp_path / "notes.txt")


# A real short training run saves the checkpoint, as tests/test_checkpoint.py makes them: the llama
# tiny model, fp32, its state sharded (FSDP) over 2 CPU devices; export reads it onto one.
def restored_forward(folder: Path, tokens: np.ndarray) -> np.ndarray:
    """The product's forward on the parameters the product's own restore reads (one CPU device)."""
    cfg = dataclasses.replace(TRAINED_LLAMA, devices=1, per_device_batch=4, sharding="replicated")
    program = TrainProgram.from_config(cfg)
    state, _ = checkpoint.restore(folder, cfg, program, step_parts(program, jax.devices()[:1]).mesh)
    model = Decoder(program.model_cfg, dtype=jnp.float32, block_wrap=no_wrap, rngs=nnx.Rngs(0))
    nnx.update(model, state.params)
    return ours(model, tokens)


def test_a_trained_llama_checkpoint_exports_and_matches_the_restored_model(trained_llama_checkpoint, tmp_path):
    summary = export_checkpoint(trained_llama_checkpoint, tmp_path, dtype="fp32")
    assert summary["model"] == "llama/tiny" and summary["step"] == TRAINED_LLAMA.steps
    assert summary["checkpoint"] == str(trained_llama_checkpoint) and summary["path"] == str(tmp_path)
    assert summary["tensors"] == 2 + 9 * 2 + 1  # embed, norm, head; 9 per layer
    tokens = np.asarray(TrainProgram.from_config(TRAINED_LLAMA).make_batch(99)["tokens"]).reshape(-1, 65)[:3, :-1]
    expected = restored_forward(trained_llama_checkpoint, tokens)
    assert relative_difference(expected, theirs(tmp_path, tokens=tokens)) <= FP32_TOLERANCE
    # trained: it predicts the synthetic task's next tokens (mostly the permutation) better than chance
    assert (expected.argmax(-1)[:, :-1] == tokens[:, 1:]).mean() > 0.3  # 0.81 measured; chance 1/256


def test_a_checkpoint_of_another_layout_or_no_checkpoint_is_refused(trained_llama_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match=f"^checkpoint: no such folder: {tmp_path / 'nowhere'}"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(ConfigError, match=f"^checkpoint: {tmp_path} is not a checkpoint folder"):
        export_checkpoint(tmp_path, tmp_path / "out")
    gpt2 = tmp_path / "gpt2"  # the description says GPT-2 layout: refused before any array is read
    shutil.copytree(trained_llama_checkpoint, gpt2)
    meta = json.loads((gpt2 / CHECKPOINT_META_FILE).read_text())
    gpt2_dims = checkpoint.model_dims(get_workload("transformer").config("tiny"))
    meta.update(workload="transformer", model={}, dims=gpt2_dims)
    (gpt2 / CHECKPOINT_META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="^norm: the model has norm layernorm"):
        export_checkpoint(gpt2, tmp_path / "out")
    shutil.rmtree(gpt2 / checkpoint.STATE_DIR)
    (gpt2 / CHECKPOINT_META_FILE).write_text(json.dumps(json.loads((trained_llama_checkpoint / CHECKPOINT_META_FILE)
                                                                    .read_text())))
    with pytest.raises(ConfigError, match=r"^checkpoint: the parameters in .*state could not be read"):
        export_checkpoint(gpt2, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_command_refuses_a_bad_checkpoint_or_dtype_in_one_line(trained_llama_checkpoint, tmp_path, capsys):
    code = main(["export-hf", "--checkpoint", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err == (f"error: invalid export: checkpoint: no such folder: {tmp_path / 'nowhere'}; allowed: a folder "
                   "written by run --save-checkpoint\n")
    code = main(["export-hf", "--checkpoint", str(trained_llama_checkpoint), "--out", str(tmp_path / "out"),
                 "--dtype", "fp8"])
    assert code == 2
    assert capsys.readouterr().err == "error: invalid export: dtype: must be one of bf16, fp16, fp32; got 'fp8'\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_command_exports_a_checkpoint_and_prints_a_summary(trained_llama_checkpoint, tmp_path):
    out = subprocess.run([sys.executable, "-m", "migration", "export-hf", "--checkpoint", str(trained_llama_checkpoint),
                          "--out", "hf", "--json", "summary.json"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    folder = tmp_path / "hf"  # relative to where the command ran
    assert f"Exported llama/tiny (step {TRAINED_LLAMA.steps}) from {trained_llama_checkpoint} to {folder}: 21 tensors" in out.stdout
    assert "in bf16" in out.stdout and "files: config.json, model.safetensors" in out.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dtype"] == "bf16" and summary["path"] == str(folder)
    tokens = TOKENS[:, :32]
    expected, got = restored_forward(trained_llama_checkpoint, tokens), theirs(folder, torch.bfloat16, tokens)
    assert relative_difference(expected, got) <= BF16_TOLERANCE and rms_ratio(expected, got) <= BF16_RMS_TOLERANCE


def test_verify_loads_the_export_back_and_catches_a_broken_one(trained_llama_checkpoint, tmp_path):
    good = export_checkpoint(trained_llama_checkpoint, tmp_path / "good", dtype="fp32", verify=True)
    assert good["verified"]["within"] and good["verified"]["max_abs_diff"] <= FP32_TOLERANCE
    assert good["weights"] == "checkpoint"
    cfg, params, _ = checkpoint.restore_params(trained_llama_checkpoint)
    bf16 = export_checkpoint(trained_llama_checkpoint, tmp_path / "bf16", dtype="bf16", verify=True)["verified"]
    assert bf16["within"] and bf16["max_abs_diff"] <= BF16_TOLERANCE
    assert (good["verified"]["tolerance"], bf16["tolerance"]) == (FP32_TOLERANCE, 0.1)
    broken = tmp_path / "good" / "model.safetensors"  # keys and values swapped in the first layer
    tensors = load_file(broken)
    k, v = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    tensors[k], tensors[v] = tensors[v], tensors[k]
    save_file(tensors, broken, metadata={"format": "pt"})
    assert not verify_export(tmp_path / "good", cfg, params, "fp32")["within"]

    # a small error, one layer's MLP output 1% off, is far outside an fp32 export's tolerance (1e-4) though
    # inside what bf16's rounding allows (0.1): the fp32 check is the tight one
    tensors[k], tensors[v] = tensors[v], tensors[k]
    down = "model.layers.0.mlp.down_proj.weight"
    tensors[down] = tensors[down] * 1.01
    save_file(tensors, broken, metadata={"format": "pt"})
    slightly = verify_export(tmp_path / "good", cfg, params, "fp32")
    assert FP32_TOLERANCE < slightly["max_abs_diff"] < 0.1 and not slightly["within"], slightly
