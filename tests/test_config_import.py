"""Configs teams already have, read as data: Hugging Face config.json files of published models and MaxText
configs (a shipped model by name, a model by its own keys), turned into the matching workload and TPU job.

Parameter counts are the published checkpoints' (the total parameter count Hugging Face shows for each
model's safetensors), as the planned model plus the parameters the reader lists as not modelled (Qwen2's
query, key and value biases, Qwen3's query and key norms, Gemma 2's extra norms)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from migration.common import ConfigError
from migration.config.imported import read_config_bytes, read_config_path, with_imported
from migration.config.requests import PlanRequest
from workloads import WORKLOADS
from workloads.configs import MAX_BYTES
from workloads.maxtext_config import shipped

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
# config.json -> published parameter count of the checkpoint (Hugging Face model pages)
PUBLISHED = {
    "llama-2-7b": 6_738_415_616, "meta-llama-3-8b": 8_030_261_248, "llama-3.2-1b": 1_235_814_400,
    "mistral-7b-v0.1": 7_241_732_096, "qwen2-7b": 7_615_616_512, "qwen3-8b": 8_190_735_360,
    "gemma-2b": 2_506_172_416, "gemma-7b": 8_537_680_896, "gemma-2-9b": 9_241_705_984, "gpt2": 124_439_808,
}


def planned_params(imported) -> int:
    w = WORKLOADS[imported.workload]
    return w.param_count(w.config(imported.preset, imported.model))


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_hugging_face_config_plans_the_published_model(name):
    imported = read_config_path(str(CONFIGS / "hf" / f"{name}.json"))
    assert planned_params(imported) + imported.missing_params == PUBLISHED[name]
    if imported.missing_params:  # what the decoder here lacks is said, with its count
        assert any(f"{imported.missing_params:,} parameters" in n for n in imported.notes)
    data = json.loads((CONFIGS / "hf" / f"{name}.json").read_text())
    noted = " ".join(imported.notes)
    assert all(k in noted for k in ("architectures", "torch_dtype") if k in data)  # read and listed, not dropped


def test_a_maxtext_config_sets_the_model_and_the_tpu_job():
    imported = read_config_path(str(CONFIGS / "maxtext" / "llama2-7b-v5p.yml"))
    assert (imported.workload, imported.name) == ("llama", "llama2-7b")
    assert planned_params(imported) == 6_738_415_616  # MaxText's llama2-7b is Meta's Llama 2 7B
    req = with_imported(PlanRequest(source="tpu-v5p-8"), imported, given={"source"})
    assert req.global_batch == 16  # per_device_batch_size 4 on the v5p-8's 4 devices
    assert (req.source_precision, req.source_sharding, req.model["seq_len"]) == ("bf16", "fsdp", 4096)
    notes = " ".join(req.config_notes)
    assert "remat_policy=full" in notes and "run_name" in notes and "learning_rate" in notes
    # flags given beside the file win: the global batch, the sequence
    mine = with_imported(PlanRequest(source="tpu-v5p-8", global_batch=64), imported, given={"source", "global_batch"},
                         model={"seq_len": 2048})
    assert mine.global_batch == 64 and mine.model["seq_len"] == 2048 and mine.model["d_model"] == 4096
    # another slice: the same per-device batch on more devices
    assert with_imported(PlanRequest(source="tpu-v5p-32"), imported, given={"source"}).global_batch == 64


def test_a_maxtext_model_by_its_own_keys_with_accumulation_and_slices():
    imported = read_config_path(str(CONFIGS / "maxtext" / "custom-decoder.yml"))
    assert imported.model["head_size"] == 256 and imported.model["d_model"] == 3072
    req = with_imported(PlanRequest(source="tpu-v5p-8"), imported, given={"source"})
    assert req.global_batch == 2 * 4 * 2 * 2 and req.source_slices == 2  # per device x devices x accumulation x slices
    notes = " ".join(req.config_notes)
    assert "my_team_flag=7: not modelled" in notes and "gradient_accumulation_steps=2" in notes
    assert imported.model["mlp"] == "geglu"  # mlp_activations [gelu, linear]: a gated GELU MLP, as written
    assert req.source_remat == "full" and "remat_policy=full: the TPU side is compiled with" in notes


def test_every_shipped_maxtext_model_of_a_planned_block_reads_and_the_others_are_refused_in_one_line():
    models = shipped()["models"]
    read, refused = {}, []
    for name, keys in models.items():
        try:
            imported = read_config_bytes(f"model_name: {name}\n".encode(), "x.yml")
        except ConfigError as exc:
            refused.append((name, str(exc)))
            continue
        assert planned_params(imported) > 0
        read[name] = imported
        assert (imported.workload == "moe") == (keys.get("num_experts", 1) > 1), name
    assert {"llama2-7b", "llama3.1-8b", "mistral-7b", "gemma-7b", "gemma2-9b", "gemma3-4b", "qwen2.5-7b", "qwen3-8b",
            "gpt3-6b", "mixtral-8x7b", "mixtral-8x22b", "deepseek3-671b", "deepseek2-16b", "qwen3-30b-a3b",
            "qwen3-235b-a22b", "llama4-17b-16e", "llama4-17b-128e"} <= set(read)
    qwen = read["qwen2.5-7b"]  # normalization_layer_epsilon: 1e-06, a float
    assert planned_params(qwen) + qwen.missing_params == 7_615_616_512  # Qwen2.5-7B's published count
    # MaxText's MoE models are the moe presets' published dimensions (tests/test_moe.py checks those against the
    # published totals); Qwen3's query and key norms are the parameters the reader lists as not modelled.
    for name, preset in (("mixtral-8x7b", "mixtral-8x7b"), ("mixtral-8x22b", "mixtral-8x22b"),
                         ("deepseek3-671b", "deepseek-v3"), ("deepseek2-16b", "deepseek-v2-lite"),
                         ("qwen3-30b-a3b", "qwen3-30b-a3b"), ("qwen3-235b-a22b", "qwen3-235b-a22b"),
                         ("llama4-17b-16e", "llama4-scout"), ("llama4-17b-128e", "llama4-maverick")):
        moe = WORKLOADS["moe"]
        planned = moe.config(read[name].preset, {k: v for k, v in read[name].model.items() if k != "seq_len"})
        assert moe.param_count(planned) == moe.param_count(moe.config(preset)), name
        assert moe.active_param_count(planned) == moe.active_param_count(moe.config(preset)), name
    assert read["deepseek3-671b"].model["attention_type"] == "mla" and read["deepseek3-671b"].model["dispatch"] == "dropless"
    assert any(n == "gpt-oss-20b" and "decoder_block='gpt_oss'" in why for n, why in refused)
    assert all("\n" not in why for _, why in refused)


@pytest.mark.parametrize("name,preset", [("mixtral-8x7b-v0.1", "mixtral-8x7b"), ("qwen3-30b-a3b", "qwen3-30b-a3b"),
                                         ("deepseek-v3", "deepseek-v3")])
def test_a_hugging_face_moe_config_plans_the_published_model(name, preset):
    """Mixtral, Qwen3-MoE and DeepSeek-V3 config.json files (as published) read as the moe workload with the
    presets' dimensions (their totals and active counts checked against the published ones in test_moe.py)."""
    imported = read_config_path(str(CONFIGS / "hf" / f"{name}.json"))
    moe = WORKLOADS["moe"]
    assert imported.workload == "moe" and imported.model["dispatch"] == "dropless"
    planned = moe.config(imported.preset, {k: v for k, v in imported.model.items() if k not in ("seq_len", "context")})
    assert moe.param_count(planned) == moe.param_count(moe.config(preset))
    assert moe.active_param_count(planned) == moe.active_param_count(moe.config(preset))
    notes = " ".join(imported.notes)
    assert "not known to this reader" not in notes, notes
    if name == "deepseek-v3":
        assert "multi-token" in notes and "noaux_tc" in notes and imported.model["attention_type"] == "mla"


def test_a_maxtext_moe_job_with_capacity_and_expert_parallelism():
    """sparse_matmul false with a capacity factor: capacity dispatch at that factor; without one MaxText computes
    every expert on every token (capacity at experts / k, nothing dropped); ici_expert_parallelism: the TPU side's
    expert split."""
    text = (b"model_name: mixtral-8x7b\nper_device_batch_size: 4\nmax_target_length: 4096\nsparse_matmul: false\n"
            b"capacity_factor: 1.25\nici_expert_parallelism: 4\nload_balance_loss_weight: 0.02\n")
    imported = read_config_bytes(text, "x.yml")
    assert imported.workload == "moe"
    assert (imported.model["dispatch"], imported.model["capacity_factor"], imported.model["aux_loss"]) == \
        ("capacity", 1.25, 0.02)
    req = with_imported(PlanRequest(source="tpu-v5p-8"), imported, given={"source"})
    assert req.source_expert == 4 and any("ici_expert_parallelism=4" in n for n in req.config_notes)
    every = read_config_bytes(b"model_name: mixtral-8x7b\nsparse_matmul: false\n", "x.yml")
    assert every.model["capacity_factor"] == 4.0 and any("every expert on every token" in n for n in every.notes)
    for bad, words in ((b"model_name: mixtral-8x7b\ndcn_expert_parallelism: 2\n", "dcn_expert_parallelism=2"),
                       (b"model_name: mixtral-8x7b\nrouted_score_func: tanh\n", "routed_score_func='tanh'"),
                       (b"decoder_block: mixtral\nnum_experts: 8\nnum_experts_per_tok: 99\n", "num_experts_per_tok")):
        with pytest.raises(ConfigError, match=words) as info:
            read_config_bytes(bad, "x.yml")
        assert "\n" not in str(info.value)


def test_maxtext_semantics_scale_precedence_slices_and_instruct():
    """As MaxText reads its config: global_parameter_scale doubles the dimensions in turn (a power of two),
    the shipped model's keys apply over the file's (said in the plan), slices multiply the DCN axes, and an
    -Instruct model has its base's architecture."""
    scaled = read_config_bytes(b"model_name: llama2-7b\nglobal_parameter_scale: 8\n", "x.yml").model
    assert (scaled["d_model"], scaled["n_heads"], scaled["d_ff"], scaled["n_layers"]) == (8192, 64, 22016, 64)
    with pytest.raises(ConfigError, match="power of two"):
        read_config_bytes(b"model_name: llama2-7b\nglobal_parameter_scale: 3\n", "x.yml")
    clash = read_config_bytes(b"model_name: llama3.1-8b\nbase_num_decoder_layers: 4\n", "x.yml")
    assert clash.model["n_layers"] == 32 and any("base_num_decoder_layers=4" in n for n in clash.notes)
    two = read_config_bytes(b"model_name: llama2-7b\nper_device_batch_size: 4\ndcn_fsdp_parallelism: 2\n", "x.yml")
    req = with_imported(PlanRequest(source="tpu-v5p-8"), two, given={"source"})
    assert (req.source_slices, req.global_batch, req.source_sharding) == (2, 32, "fsdp")
    assert read_config_bytes(b"model_name: llama3.1-8b-Instruct\n", "x.yml").model["n_layers"] == 32
    # Gemma 3 always normalises queries and keys: the same count from MaxText as from its config.json
    gemma3 = read_config_bytes(b"model_name: gemma3-4b\n", "x.yml")
    assert gemma3.missing_params == 34 * (2 * 256 + 2 * 2560)


def test_hugging_face_defaults_and_newer_keys():
    qwen3 = {"model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True}
    imported = read_config_bytes(json.dumps(qwen3).encode(), "config.json")
    assert imported.model["head_size"] == 128  # Qwen3Config's default, not 1024 / 16
    total = planned_params(imported) + imported.missing_params  # Qwen3-0.6B's card: 0.6B, 0.44B without embeddings
    assert round(total / 1e9, 1) == 0.6 and round((total - 151936 * 1024) / 1e9, 2) == 0.44
    llama = json.loads((CONFIGS / "hf" / "llama-3.2-1b.json").read_text())
    newer = {k: v for k, v in llama.items() if k not in ("rope_scaling", "rope_theta")}
    newer["rope_parameters"] = {**llama["rope_scaling"], "rope_theta": llama["rope_theta"]}
    assert read_config_bytes(json.dumps(newer).encode(), "config.json").model == \
        read_config_path(str(CONFIGS / "hf" / "llama-3.2-1b.json")).model
    bom = b"\xef\xbb\xbf" + (CONFIGS / "hf" / "gpt2.json").read_bytes()
    assert read_config_bytes(bom, "config.json").model["d_model"] == 768
    assert read_config_bytes(b'{"model_name": "llama2-7b"}', "run.yml").name == "llama2-7b"


@pytest.mark.parametrize("text, words", [
    (b'{"model_type": "llama", "hidden_size": "4096"}', "hidden_size: expected an integer"),
    (b'{"model_type": "mixtral", "num_local_experts": 8}', "hidden_size"),
    (b'{"model_type": "dbrx", "ffn_config": {}}', "mixture-of-experts families read are"),
    (b'{"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, '
     b'"intermediate_size": 64, "vocab_size": 10, "num_experts": 4, "num_experts_per_tok": 2, '
     b'"moe_intermediate_size": 32, "mlp_only_layers": [1]}', "mlp_only_layers"),
    (b'{"model_type": "bert"}', "model_type='bert'"),
    (b"model_name: llama2-7b\ndcn_tensor_parallelism: 4\n", "dcn_tensor_parallelism=4"),
    (b"model_name: llama2-7b\nici_sequence_parallelism: 2\n", "ici_sequence_parallelism=2"),
    (b"model_name: llama2-7b\nper_device_batch_size: four\n", "per_device_batch_size"),
    (b"model_name: llama2-7b\nquantization: int8\n", "quantization"),
    (b"model_name: llama9-7b\n", "nearest: llama2-7b"),
    (b"a: &x [1, 2]\nb: *x\nmodel_name: llama2-7b\n", "alias"),
    (b"hello: world\n", "neither a Hugging Face config.json"),
    (b"- a\n- b\n", "not a mapping"),
    (b"\xff\xfe\x00", "not UTF-8"),
    (b"{" + b" " * MAX_BYTES + b"}", "at most"),
    (b"model_name: !!python/object/apply:os.system [echo hi]\n", "neither JSON nor YAML"),
    (b"a: [\n", "neither JSON nor YAML"),
    (b"model_name: llama2-7b\nrun_name: 2024-01-01\nper_device_batch_size: x\n", "per_device_batch_size"),
    (b"model_name: llama2-7b\nper_device_batch_size: " + b"9" * 5000 + b"\n", "4300 digits"),
    (b'{"model_type": ' + b"[" * 20000 + b"]" * 20000 + b"}", "not valid JSON"),
    (b"x: " + b"[" * 20000 + b"]" * 20000 + b"\n", "more than 32 deep"),  # refused before PyYAML spends seconds
    (b'{"model_type": "gemma3", "text_config": [1]}', "text_config"),
    (b'{"model_type": "llama", "num_local_experts": 8.0}', "num_local_experts=8.0"),
])
def test_a_bad_config_is_one_line_naming_the_problem(text, words):
    """(A YAML tag that would call a function is refused by the safe loader; nothing runs.)"""
    with pytest.raises(ConfigError) as info:
        read_config_bytes(text, "config")
    assert info.value.field == "config" and words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("config, source, batch", [("hf/tiny-random-llama.json", "tpu-v5e-8", "32"),
                                                   ("maxtext/tiny-decoder-v5p.yml", "tpu-v5p-8", None)])
def test_plan_config_from_a_file_through_the_command_line(config, source, batch, tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "--config-from", str(CONFIGS / config), "--source", source, "--target", "h100-sxm", "--quiet",
            "--json", str(out)] + (["--global-batch", batch] if batch else [])
    proc = subprocess.run([sys.executable, "-m", "migration", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    plan = json.loads(out.read_text())
    assert plan["status"] == "ok" and plan["workload"] == "llama"
    decisions = {d["decision"]: d for d in plan["decisions"]}
    imported = decisions["imported_config"]
    if config.startswith("maxtext"):
        assert plan["global_batch"] == 8 and plan["model"]["seq_len"] == 256  # 2 per device x 4 devices
        assert "remat_policy=minimal" in imported["reason"]
    else:
        assert plan["global_batch"] == 32 and plan["model"]["d_model"] == 64
        assert "Hugging Face config.json (llama)" in imported["value"]
    assert plan["param_count"] > 0


def test_a_config_is_data_a_yaml_tag_never_runs(tmp_path):
    marker = tmp_path / "ran"
    text = f"model_name: !!python/object/apply:os.system [touch {marker}]\nper_device_batch_size: 1\n"
    with pytest.raises(ConfigError):
        read_config_bytes(text.encode(), "x.yml")
    assert not marker.exists()
