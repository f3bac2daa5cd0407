"""A MaxText config as the decoder and the TPU job it describes (see workloads/configs.py).

MaxText is read as data, never imported (its wheels need Python 3.12 and JAX 0.11.1, and its GPU
compile a GPU). A file may name one of MaxText's shipped models (`model_name`, whose keys come from
workloads/maxtext_models.json, read from MaxText's `configs/models/`), give the model's keys itself
(`base_emb_dim`, `base_num_decoder_layers`, `base_num_query_heads`, `base_num_kv_heads`, `base_mlp_dim`,
`head_dim`, `vocab_size`, `mlp_activations`, `logits_via_embedding`, `decoder_block`, ...), or both (the
file's keys win, then the model's, then base.yml's defaults below).

The TPU job: `per_device_batch_size` per chip (times the slice's chips, `gradient_accumulation_steps`
and the slices, the global batch), `max_target_length` (the sequence), `dtype` (the TPU's precision),
`ici_fsdp_parallelism` / `ici_data_parallelism` (state sharded or replicated over the slice) and
`dcn_data_parallelism` / `num_slices` (data parallelism across slices), `ici_tensor_parallelism` (tensor
parallelism inside a slice, beside the FSDP), `ici_expert_parallelism` (a mixture-of-experts model's experts
split inside a slice). Tensor and expert parallelism across slices, sequence, context and pipeline
parallelism on the TPU are not planned here: such a key is an error naming it.

A mixture-of-experts model (`num_experts` > 1, decoder_block mixtral, deepseek, qwen3_moe or llama4) is the
`moe` workload: experts, top-k, `base_moe_mlp_dim`, shared experts, the first dense layers, the MoE layer
step, the router's score, scale and normalisation, the load-balancing weight, `sparse_matmul` /
`capacity_factor` (dropless or capacity dispatch) and multi-head latent attention's ranks.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workloads.config_keys import ConfigFileError, Imported, Reader, listed, short

MODELS_FILE = Path(__file__).with_name("maxtext_models.json")
# MaxText's base.yml defaults for the keys read here (src/maxtext/configs/base.yml at the commit of
# maxtext_models.json's source).
BASE = {
    "global_parameter_scale": 1, "base_emb_dim": 2048, "base_num_query_heads": 16, "base_num_kv_heads": 16,
    "base_mlp_dim": 7168, "base_num_decoder_layers": 16, "head_dim": 128, "mlp_activations": ["silu", "linear"],
    "vocab_size": 32000, "logits_via_embedding": False, "decoder_block": "llama2", "normalization_layer_epsilon": 1e-5,
    "rope_max_timescale": 10000, "max_target_length": 2048, "per_device_batch_size": 12.0, "remat_policy": "full",
    "dtype": "bfloat16", "weight_dtype": "float32", "mu_dtype": "", "ici_fsdp_parallelism": -1, "ici_data_parallelism": 1, "ici_tensor_parallelism": 1,
    "dcn_data_parallelism": -1, "dcn_fsdp_parallelism": 1, "num_experts": 1, "gradient_accumulation_steps": 1,
    "num_slices": -1, "scan_layers": True, "attention": "autoselected", "quantization": "", "use_qk_norm": False,
    "attention_bias": False, "use_post_attn_norm": False, "use_post_ffw_norm": False, "sliding_window_size": 0,
    "trainable_position_size": -1,
    # mixture-of-experts keys (base.yml's defaults)
    "num_experts_per_tok": 1, "base_moe_mlp_dim": -1, "shared_experts": 0, "first_num_dense_layers": 0,
    "interleave_moe_layer_step": 1, "sparse_matmul": True, "megablox": True, "capacity_factor": -1.0,
    "load_balance_loss_weight": 0.0, "norm_topk_prob": False, "routed_scaling_factor": 1.0, "routed_score_func": "",
    "routed_bias": False, "attention_type": "global", "q_lora_rank": 0, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "ici_expert_parallelism": 1,
}
MARKERS = ("model_name", "base_emb_dim", "base_num_decoder_layers", "base_num_query_heads", "base_num_kv_heads",
           "base_mlp_dim", "per_device_batch_size", "max_target_length", "remat_policy", "decoder_block",
           "global_parameter_scale", "ici_fsdp_parallelism", "ici_data_parallelism", "ici_tensor_parallelism",
           "dcn_data_parallelism", "logits_via_embedding", "mlp_activations")
KNOWN_KEYS = frozenset(MARKERS)
MODERN_BLOCKS = ("llama2", "mistral", "gemma", "gemma2", "gemma3", "qwen2", "qwen3")
# MaxText's mixture-of-experts decoder blocks planned here, and the `moe` preset whose layout each starts from.
MOE_BLOCKS = {"mixtral": "mixtral-8x7b", "deepseek": "deepseek-v3", "qwen3_moe": "qwen3-30b-a3b",
              "llama4": "llama4-scout"}
GPT_BLOCKS = ("gpt3",)
# Parallelism over the slice or across slices that the TPU side here does not plan (>1 is an error).
UNPLANNED_PARALLELISM = tuple(f"{net}_{axis}_parallelism" for net in ("ici", "dcn") for axis in (
    "fsdp_transpose", "sequence", "context", "context_autoregressive", "tensor", "tensor_sequence", "pipeline",
    "expert", "autoregressive", "diloco", "context_usp_ulysses") if (net, axis) not in (("ici", "tensor"), ("ici", "expert")))
# Keys with no bearing on memory or step time (training loop, data, logging, checkpoints, optimizer constants).
NO_BEARING_PREFIXES = ("dataset_", "tokenizer_", "eval_", "log", "checkpoint", "enable_", "adam_", "learning_rate",
                       "warmup", "cosine", "profiler", "run_name", "base_output_directory", "steps", "hf_", "grain_",
                       "gcs_", "save_", "load_", "metrics_", "hardware", "async_checkpointing", "skip_", "jax_cache",
                       "dcn_bandwidth", "upload", "train_data", "eval_data", "packing", "add_bos", "add_eos")


@functools.lru_cache(maxsize=1)
def shipped() -> dict[str, Any]:
    """MaxText's shipped model configs as data: {"source", "read", "models": {name: keys}}."""
    return json.loads(MODELS_FILE.read_text())


def read_maxtext(data: Mapping[str, Any]) -> Imported:
    data = {k: v for k, v in data.items() if v is not None}  # an empty key keeps base.yml's value
    name_value = data.get("model_name", "default")
    if not isinstance(name_value, str):
        raise ConfigFileError(f"MaxText config model_name: expected a string, got {short(name_value)}")
    name_value = name_value.replace("-Instruct", "")  # as MaxText: an instruct model has its base's architecture
    model_keys = _shipped_keys(name_value)
    notes: list[str] = []
    # MaxText applies the model's keys over the config file's (the command line's over both)
    clash = sorted(k for k in data if k in model_keys and data[k] != model_keys[k])
    if clash:
        notes.append(f"{', '.join(f'{k}={short(data[k], 20)}' for k in clash)}: model_name {name_value} sets "
                     f"{', '.join(f'{k}={short(model_keys[k], 20)}' for k in clash)}, which MaxText applies over the "
                     "file's (as planned here); give yours as flags here, or on MaxText's command line")
    stated = {**data, **model_keys}  # what the file and its model say (listed if unused)
    r = Reader({**BASE, **stated}, "MaxText config")
    r.used.add("model_name")
    _refuse(r)
    block = r.str("decoder_block")
    experts = r.int("num_experts", lo=0, hi=100_000)
    if experts > 1 and block == "mistral":  # MaxText's Mixtral configs before its mixtral block (2024)
        notes.append("decoder_block=mistral with num_experts: MaxText's Mixtral of 2024, planned as its mixtral block")
        block = "mixtral"
    if experts > 1 and block not in MOE_BLOCKS:
        raise ConfigFileError(f"{r.where} num_experts={experts} with decoder_block={block!r}: the mixture-of-experts "
                              f"blocks planned here are {', '.join(MOE_BLOCKS)}")
    if experts <= 1 and block not in MODERN_BLOCKS + GPT_BLOCKS:
        raise ConfigFileError(f"{r.where} decoder_block={block!r}: the families planned here are "
                              f"{', '.join(MODERN_BLOCKS + GPT_BLOCKS)} (and, with num_experts, {', '.join(MOE_BLOCKS)})")
    model = _dimensions(r, block, notes)
    workload, preset = ("transformer", "gpt2-small") if block in GPT_BLOCKS else ("llama", "8b")
    if experts > 1:
        model.update(_moe_dimensions(r, block, experts, model, notes))
        workload, preset = "moe", MOE_BLOCKS[block]
    missing = _missing(r, block, model, notes)
    window = r.int("sliding_window_size", lo=0, hi=10**8)
    if window:
        notes.append(f"sliding_window_size={window}: planned as full causal attention over the sequence "
                     + ("(the same at this length)" if window >= model["seq_len"] else "(more attention FLOPs and memory)"))
    if not r.bool("scan_layers"):
        model["layer_loop"] = "unrolled"
    settings = _tpu_settings(r, notes)
    imported = Imported("MaxText config", name_value if name_value != "default" else block, workload, preset, model,
                        settings, tuple(notes), missing)
    return _with_unused(imported, r, stated)


def _shipped_keys(name: str) -> dict[str, Any]:
    """The keys of MaxText's shipped model `name` ("default": none), or ConfigFileError naming the nearest."""
    if name == "default":
        return {}
    models = shipped()["models"]
    if name not in models:
        near = difflib.get_close_matches(name, models, n=4, cutoff=0.5)
        raise ConfigFileError(f"MaxText config model_name={name!r}: not one of MaxText's shipped models"
                              + (f" (nearest: {', '.join(near)})" if near else "")
                              + f"; {len(models)} known, read from {shipped()['source']}")
    return dict(models[name])


def _dimensions(r: Reader, block: str, notes: list[str]) -> dict[str, Any]:
    """The decoder's fields from MaxText's model keys (scaled by global_parameter_scale as MaxText does)."""
    emb, head_scale, mlp, layer = _scales(r.int("global_parameter_scale", hi=2**20))
    d, heads = r.int("base_emb_dim", lo=8) * emb, r.int("base_num_query_heads") * head_scale
    kv, ff = r.int("base_num_kv_heads") * head_scale, r.int("base_mlp_dim") * mlp
    layers = r.int("base_num_decoder_layers") * layer
    if block == "gemma2":  # MaxText scans Gemma 2's local and global attention layers as one
        layers *= 2
        notes.append(f"decoder_block=gemma2: base_num_decoder_layers counts local and global attention layers as "
                     f"one (MaxText's scan): {layers} layers")
    head = r.int("head_dim", hi=1024)
    if heads % kv:
        raise ConfigFileError(f"{r.where} base_num_kv_heads={kv}: must divide base_num_query_heads={heads}")
    acts = r.raw("mlp_activations")
    if not isinstance(acts, list) or not all(isinstance(a, str) for a in acts):
        raise ConfigFileError(f"{r.where} mlp_activations: expected a list of names, got {acts!r}")
    model: dict[str, Any] = {
        "vocab_size": r.int("vocab_size"), "seq_len": r.int("max_target_length", hi=131072), "d_model": d,
        "n_layers": layers, "n_heads": heads, "n_kv_heads": kv, "d_ff": ff, "head_size": 0 if head * heads == d else head,
        "tied_embeddings": r.bool("logits_via_embedding"),
        "norm_eps": r.number("normalization_layer_epsilon", lo=1e-12, hi=0.1),
    }
    mlp = MAXTEXT_MLPS.get(tuple(acts))
    if mlp is None:
        raise ConfigFileError(f"{r.where} mlp_activations={acts}: the decoder here computes "
                              + ", ".join(f"[{', '.join(k)}]" for k in MAXTEXT_MLPS))
    model["mlp"] = mlp
    if block in GPT_BLOCKS:
        return model
    model.update(rope_theta=r.number("rope_max_timescale", lo=1, hi=1e9), rope_scaling=1.0, context=0)
    return model


def _moe_dimensions(r: Reader, block: str, experts: int, model: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """The `moe` workload's fields from MaxText's mixture-of-experts keys (MaxText's layers/moe.py semantics:
    `sparse_matmul` computes every slot by grouped products, else `capacity_factor` > 0 drops past each
    expert's capacity and <= 0 computes every expert on every token)."""
    _, _, mlp_scale, _ = _scales(r.int("global_parameter_scale", hi=2**20))
    moe_dim = r.int("base_moe_mlp_dim", lo=-1)
    score = r.str("routed_score_func") or "softmax"
    if score not in ("softmax", "sigmoid"):
        raise ConfigFileError(f"{r.where} routed_score_func={score!r}: the router here scores by softmax or sigmoid")
    out: dict[str, Any] = {
        "n_experts": experts, "top_k": r.int("num_experts_per_tok", lo=1, hi=64),
        # base_moe_mlp_dim unset: MaxText's experts are base_mlp_dim wide (its Mixtral configs before the key)
        "expert_d_ff": moe_dim * mlp_scale if moe_dim > 0 else model["d_ff"], "n_shared_experts": r.int("shared_experts", lo=0),
        "first_dense": r.int("first_num_dense_layers", lo=0), "moe_period": r.int("interleave_moe_layer_step", lo=1),
        "router_score": score, "router_scale": r.number("routed_scaling_factor", lo=0.001, hi=1000),
        # Mixtral's weights are the softmax of the k chosen logits (renormalised); DeepSeek's sigmoid scores are
        # renormalised over the k; Qwen3 says so with norm_topk_prob; Llama 4's top-1 sigmoid is not
        "router_topk_norm": block == "mixtral" or r.bool("norm_topk_prob") or (block == "deepseek" and score == "sigmoid"),
        "aux_loss": r.number("load_balance_loss_weight", lo=0, hi=10),
    }
    cf = r.number("capacity_factor", lo=-1e6, hi=64)
    if r.bool("sparse_matmul"):
        out["dispatch"] = "dropless"
        if cf > 0:
            notes.append(f"capacity_factor={cf:g} with sparse_matmul: planned dropless (every slot computed by "
                         "grouped products)")
    else:
        out["dispatch"] = "capacity"
        out["capacity_factor"] = cf if cf > 0 else experts / out["top_k"]
        if cf <= 0:
            notes.append(f"sparse_matmul=false without a capacity_factor: MaxText computes every expert on every "
                         f"token; planned as capacity dispatch at {experts / out['top_k']:g} (nothing dropped)")
    attention = r.str("attention_type")
    if attention == "mla":
        out.update(attention_type="mla", q_lora_rank=r.int("q_lora_rank", lo=0), kv_lora_rank=r.int("kv_lora_rank"),
                   qk_nope_head_dim=r.int("qk_nope_head_dim"), qk_rope_head_dim=r.int("qk_rope_head_dim"),
                   v_head_dim=r.int("v_head_dim"), head_size=0, attention="xla")
    elif attention not in ("global", "full"):
        notes.append(f"attention_type={attention}: planned as full causal attention over the sequence")
    if r.bool("routed_bias"):
        notes.append("routed_bias=true (DeepSeek's auxiliary-loss-free balancing bias): planned without the "
                     f"router's bias ({experts} values a MoE layer) and its update")
    return out


# MaxText's mlp_activations as the decoder's MLP: one activation is a plain MLP, an activation and
# "linear" a gated one (the gate's activation times the linear up projection).
MAXTEXT_MLPS = {("gelu",): "gelu", ("relu",): "relu", ("squared_relu",): "squared_relu", ("silu", "linear"): "swiglu",
                ("gelu", "linear"): "geglu"}


def _scales(scale: int) -> tuple[int, int, int, int]:
    """The factors of the embedding, the heads, the MLP and the layers for `global_parameter_scale` (MaxText's
    `get_individual_scales`: a power of two, its doublings spread over the four in turn)."""
    if scale & (scale - 1):
        raise ConfigFileError(f"MaxText config global_parameter_scale={scale}: must be a power of two (as in MaxText)")
    base, rem = divmod(scale.bit_length() - 1, 3)
    heads = base + int(rem > 0)
    return 2 ** (base + int(rem > 1)), 2 ** heads, 2 ** heads, 2 ** base


def _missing(r: Reader, block: str, model: dict[str, Any], notes: list[str]) -> int:
    """Parameters of the file's model that the decoder here lacks, counted and listed in `notes`."""
    layers, d, seq = model["n_layers"], model["d_model"], model["seq_len"]
    head = model["head_size"] or d // model["n_heads"]
    missing, parts = 0, []
    if block in GPT_BLOCKS:
        positions = r.int("trainable_position_size", hi=10**6, lo=-1)
        if positions > seq:
            missing += (positions - seq) * d
            parts.append(f"a position table of {positions:,} rows where the sequence uses {seq:,} "
                         f"({(positions - seq) * d:,})")
    if r.bool("attention_bias"):
        per = (model["n_heads"] + 2 * model["n_kv_heads"]) * head
        missing += layers * per
        parts.append(f"query, key and value biases ({layers * per:,})")
    if r.bool("use_qk_norm") or block == "gemma3":  # Gemma 3 normalises queries and keys whatever the key says
        missing += layers * 2 * head
        parts.append(f"query and key norms ({layers * 2 * head:,})")
    for key in ("use_post_attn_norm", "use_post_ffw_norm"):
        if r.bool(key):
            missing += layers * d
            parts.append(f"{key.removeprefix('use_').replace('_', ' ')}s ({layers * d:,})")
    if parts:
        notes.append(f"{missing:,} parameters the decoder here does not have: {'; '.join(parts)}; planned without them")
    return missing


def _refuse(r: Reader) -> None:
    """Errors for keys that change the answer and are not planned here."""
    quant = r.str("quantization")
    if quant:
        raise ConfigFileError(f"{r.where} quantization={quant!r}: quantized training is not planned here")
    for key in UNPLANNED_PARALLELISM:
        if key in r.data:
            value = r.int(key, lo=-1, hi=100_000)
            if value not in (1, 0):
                raise ConfigFileError(f"{r.where} {key}={value}: the TPU side is planned with data and FSDP "
                                      "parallelism (ici/dcn data and fsdp), tensor and expert parallelism inside a "
                                      "slice (ici_tensor_parallelism, ici_expert_parallelism) only")


def _tpu_settings(r: Reader, notes: list[str]) -> dict[str, Any]:
    per_device = r.number("per_device_batch_size", lo=1e-6, hi=65536)
    dtype = r.str("dtype")
    precision = {"bfloat16": "bf16", "float32": "fp32"}.get(dtype)
    if precision is None:
        raise ConfigFileError(f"{r.where} dtype={dtype!r}: the TPU side is planned in bfloat16 or float32")
    weights = r.str("weight_dtype")
    if weights != "float32":
        notes.append(f"weight_dtype={weights}: the plan keeps float32 master weights (and counts their memory)")
    mu = r.str("mu_dtype") or weights  # MaxText: AdamW's first moment in weight_dtype unless mu_dtype is set
    if mu not in ("float32", "bfloat16"):
        notes.append(f"mu_dtype={mu}: AdamW's first moment is planned in float32 (float32 or bfloat16 are planned)")
        mu = "float32"
    fsdp, data = r.int("ici_fsdp_parallelism", lo=-1), r.int("ici_data_parallelism", lo=-1)
    dcn_fsdp = r.int("dcn_fsdp_parallelism", lo=-1)
    num_slices = r.int("num_slices", lo=-1)
    across = [v for v in (r.int("dcn_data_parallelism", lo=-1), dcn_fsdp) if v > 1]
    slices = num_slices if num_slices > 0 else max(1, math.prod(across))
    remat = _remat(r, notes)
    attention = r.str("attention")
    if attention not in ("autoselected", "dot_product"):
        notes.append(f"attention={attention}: the GPU plan picks its own attention kernel (cuDNN's fused one where "
                     "it can)")
    return {"per_device_batch": per_device, "accumulation": r.int("gradient_accumulation_steps", hi=65536),
            "slices": slices, "source_precision": precision,
            "source_sharding": "fsdp" if fsdp != 1 or dcn_fsdp not in (1, 0) else "replicated",
            "source_remat": remat, "source_dcn_fsdp": slices > 1 and dcn_fsdp not in (1, 0),
            "source_tensor": r.int("ici_tensor_parallelism", lo=1, hi=4096),
            "source_expert": r.int("ici_expert_parallelism", lo=1, hi=4096), "data_parallelism": data,
            "mu_dtype": mu}


# MaxText's remat policies (layers.decoders) and the tensors its `custom` policy places (each device, offload or
# remat); migration/config/limits.py translates both into this product's policies.
MAXTEXT_REMAT_NAMES = ("none", "minimal", "minimal_with_context", "minimal_flash", "full",
                       "save_dot_with_context_except_mlp", "save_qkv_proj", "save_dot_except_mlp", "save_dot_except_mlpwi",
                       "save_out_proj", "qkv_proj_offloaded", "minimal_offloaded")
MAXTEXT_REMAT_TENSORS = ("decoder_layer_input", "query_proj", "key_proj", "value_proj", "qkv_proj", "context",
                         "out_proj", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo")


def _remat(r: Reader, notes: list[str]) -> str | dict[str, str]:
    """The TPU job's remat policy: MaxText's name, or for `custom` its per-tensor keys ({"decoder_layer_input":
    "offload", ...})."""
    remat = r.str("remat_policy")
    if remat == "custom":
        tensors = {k: r.str(k) for k in MAXTEXT_REMAT_TENSORS if r.has(k)}
        bad = {k: v for k, v in tensors.items() if v not in ("device", "offload", "remat")}
        if bad:
            raise ConfigFileError(f"{r.where} remat_policy=custom: each tensor is device, offload or remat; got "
                                  + ", ".join(f"{k}={short(v)}" for k, v in bad.items()))
        return tensors
    if remat not in MAXTEXT_REMAT_NAMES:
        raise ConfigFileError(f"{r.where} remat_policy={remat!r}: not one of MaxText's policies "
                              f"({', '.join(MAXTEXT_REMAT_NAMES)}, custom)")
    return remat


def _with_unused(imported: Imported, r: Reader, stated: Mapping[str, Any]) -> Imported:
    unused = [k for k in stated if k not in r.used]
    quiet = sorted(k for k in unused if k.startswith(NO_BEARING_PREFIXES) or k in ("opt_type",
                                                                                  "gradient_clipping_threshold", "base_config"))
    rest = sorted(k for k in unused if k not in quiet)
    notes = list(imported.notes)
    for keys, why in ((quiet, "read, no bearing on memory or step time"),
                      (rest, "not modelled by this reader")):
        note = listed(keys, stated, why)
        if note:
            notes.append(note)
    return Imported(imported.format, imported.name, imported.workload, imported.preset, imported.model,
                    imported.settings, tuple(notes), imported.missing_params)


__all__ = ["KNOWN_KEYS", "read_maxtext", "shipped"]
