"""A Llama-family model handed over to Hugging Face: a folder `transformers.LlamaForCausalLM.from_pretrained`
loads (`config.json`, safetensors) and that computes the logits the model computes, so that a model
trained here is served or evaluated by the tools that read that layout (vLLM, TGI, lm-eval, ...).

How workloads/transformer.py's parameters map to HF's names (`hf_tensors`):
- Flax kernels are (in, out), torch's Linear weights (out, in): every kernel is transposed.
- `attn.kv` fuses keys then values (its output read as (2, kv heads, head size)): `k_proj` is the first
  half of its columns, `v_proj` the second. `mlp.up` fuses gate then up (SiLU of the first half times
  the second): `gate_proj`, then `up_proj`.
- Rotary positions rotate the two halves of each head ((x1, x2) -> (x1 c - x2 s, x1 s + x2 c)), HF's
  `rotate_half` convention: q and k columns are written as they are (Meta's original checkpoints pair
  interleaved dimensions and need HF's per-head permutation; these do not). Query head h reads kv
  head h // (heads / kv heads), as HF's `repeat_kv` does.
- RMSNorm (statistics in float32, a scale, no bias, no mean) with the model's epsilon; `rope_theta`
  as the model's; Llama 3's frequency scaling ("llama3" rope_type, legacy `rope_scaling` key, which
  every transformers version reads) only where the model scales (`rope_scaling` > 1), else none.
  Biases (`bias`) become `attention_bias` and `mlp_bias`. Tied embeddings: no `lm_head.weight`.
Only that layout is exported: another (the GPT-2 layout: LayerNorm, GELU, learned positions) is
refused with a ConfigError naming the field. No tokenizer is written: the workloads' tokens are ids.

Files: `model.safetensors` (metadata format "pt"), or above `max_shard_bytes` (5 GB, HF's shard size)
`model-0000i-of-0000n.safetensors` and `model.safetensors.index.json`, as `save_pretrained` writes them.
The host holds the float32 parameters and the converted copy: 6 bytes a parameter in bf16 (48 GB for
Llama 3.1 8B). A checkpoint is read for its parameters only (no optimizer state), onto the CPU.

Tolerance (tests/test_export_hf.py, HF on the CPU), the largest difference over the largest logit at
any position: 1e-4 for an fp32 export; 0.1 for bf16 with HF computing in bf16 (0.03 as RMS ratio),
as far as the model's own bf16 forward is from its fp32 one (HF casts after the norm's float32
statistics, then scales; Flax scales, then casts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from migration.common import ConfigError
from migration.running import checkpoint
from workloads.base import no_wrap
from workloads.transformer import Decoder, TransformerConfig

DTYPES = {"bf16": (ml_dtypes.bfloat16, "bfloat16"), "fp16": (np.float16, "float16"), "fp32": (np.float32, "float32")}
MAX_SHARD_BYTES = 5 * 10**9
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The fields that make the Llama layout, and the value each needs.
LLAMA_LAYOUT = {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope"}


def hf_config(cfg: TransformerConfig, dtype: str = "bf16") -> dict[str, Any]:
    """`config.json` of LlamaForCausalLM for `cfg`; ConfigError naming the field where `cfg` is not
    the Llama layout."""
    check_layout(cfg)
    scaled = cfg.rope_scaling != 1
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_context,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_context,
        } if scaled else None,
        "tie_word_embeddings": cfg.tied_embeddings,
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        # The synthetic tokens have no special ids: generation runs to its length limit.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": _dtype(dtype)[1],
        "dtype": _dtype(dtype)[1],
    }


def check_layout(cfg: Any) -> None:
    """ConfigError unless `cfg` is a decoder of the Llama layout (the llama workload's)."""
    if not isinstance(cfg, TransformerConfig):
        raise ConfigError("workload", f"the model is {type(cfg).__name__}, not a decoder; export to Hugging Face "
                                      "takes the llama family (RMSNorm, SwiGLU MLP, rotary positions)")
    if hasattr(cfg, "n_experts"):
        raise ConfigError("workload", "the model is a mixture of experts; export to Hugging Face takes the dense llama "
                                      "family (an MoE checkpoint's layout, Mixtral's or DeepSeek's, is not written)")
    wrong = [name for name, value in LLAMA_LAYOUT.items() if getattr(cfg, name) != value]
    if wrong:
        got = ", ".join(f"{name} {getattr(cfg, name)}" for name in wrong)
        need = ", ".join(f"{name} {value}" for name, value in LLAMA_LAYOUT.items())
        raise ConfigError(wrong[0], f"the model has {got}; Hugging Face's Llama layout (LlamaForCausalLM) needs "
                                    f"{need}: the llama workload's models are exported, the GPT-2 layout "
                                    "(transformer workload) has no Llama equivalent")


def hf_tensors(cfg: TransformerConfig, state: Any, dtype: str = "fp32") -> dict[str, np.ndarray]:
    """The parameters (a Decoder, its nnx.State of Params, or that state as a pure dict) under HF's
    names, in HF's order, as contiguous host arrays of `dtype` in torch's (out, in) layout."""
    check_layout(cfg)
    np_dtype = _dtype(dtype)[0]
    p = _flat_params(state)
    _check_shapes(cfg, p)

    def out(a: Any) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np_dtype)

    f, kv = cfg.d_ff, cfg.n_kv_heads * cfg.head_dim
    tensors = {"model.embed_tokens.weight": out(p["embed.embedding"])}
    for i in range(cfg.n_layers):
        name = f"model.layers.{i}"
        layer = {k[len("blocks."):]: v[i] for k, v in p.items() if k.startswith("blocks.")}
        tensors[f"{name}.input_layernorm.weight"] = out(layer["norm1.scale"])
        k_v = layer["attn.kv.kernel"]
        for proj, kernel in (("q_proj", layer["attn.q.kernel"]), ("k_proj", k_v[:, :kv]), ("v_proj", k_v[:, kv:]),
                             ("o_proj", layer["attn.out.kernel"])):
            tensors[f"{name}.self_attn.{proj}.weight"] = out(kernel.T)
        if cfg.bias:
            kv_bias = layer["attn.kv.bias"]
            for proj, bias in (("q_proj", layer["attn.q.bias"]), ("k_proj", kv_bias[:kv]), ("v_proj", kv_bias[kv:]),
                               ("o_proj", layer["attn.out.bias"])):
                tensors[f"{name}.self_attn.{proj}.bias"] = out(bias)
        tensors[f"{name}.post_attention_layernorm.weight"] = out(layer["norm2.scale"])
        up = layer["mlp.up.kernel"]
        for proj, kernel in (("gate_proj", up[:, :f]), ("up_proj", up[:, f:]), ("down_proj", layer["mlp.down.kernel"])):
            tensors[f"{name}.mlp.{proj}.weight"] = out(kernel.T)
        if cfg.bias:
            up_bias = layer["mlp.up.bias"]
            for proj, bias in (("gate_proj", up_bias[:f]), ("up_proj", up_bias[f:]),
                               ("down_proj", layer["mlp.down.bias"])):
                tensors[f"{name}.mlp.{proj}.bias"] = out(bias)
    tensors["model.norm.weight"] = out(p["norm_f.scale"])
    if not cfg.tied_embeddings:
        tensors["lm_head.weight"] = out(p["head.kernel"].T)
    return tensors


def export_hf(model_or_state: Any, cfg: TransformerConfig, out_dir: str | Path, dtype: str = "bf16", *,
              max_shard_bytes: int = MAX_SHARD_BYTES) -> dict[str, Any]:
    """Write `config.json` and the safetensors of the model (a Decoder, or its parameters as
    `hf_tensors` takes them) to the folder `out_dir` (new, empty, or holding an earlier export, which
    is replaced). Returns what was written: path, files, bytes, tensors, parameters, dtype."""
    config = hf_config(cfg, dtype)
    out, earlier = _export_folder(Path(out_dir))
    tensors = hf_tensors(cfg, model_or_state, dtype)
    out.mkdir(parents=True, exist_ok=True)
    for file in earlier:
        file.unlink()
    shards = _shards(tensors, max_shard_bytes)
    files = [SINGLE_FILE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                     for i in range(len(shards))]
    for file, names in zip(files, shards):
        save_file({name: tensors[name] for name in names}, out / file, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                 "weight_map": {name: file for file, names in zip(files, shards) for name in names}}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    files.insert(0, CONFIG_FILE)
    mode = (out / CONFIG_FILE).stat().st_mode & 0o777  # the umask's; safetensors writes its files private
    for file in files:
        os.chmod(out / file, mode)
    return {"path": str(out), "files": files, "bytes": sum((out / f).stat().st_size for f in files),
            "tensors": len(tensors), "parameters": sum(t.size for t in tensors.values()), "dtype": dtype}


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, dtype: str = "bf16", *,
                      max_shard_bytes: int = MAX_SHARD_BYTES, verify: bool = False) -> dict[str, Any]:
    """A training checkpoint (migration/running/checkpoint.py) of a llama-family model exported as
    `export_hf` does, its parameters restored onto the CPU; the summary also names the model, the
    step and the checkpoint, and with `verify`, the export loaded back and compared (verify_export)."""
    _dtype(dtype)  # refused before anything is read
    _export_folder(Path(out_dir))
    cfg, params, meta = checkpoint.restore_params(checkpoint_dir, accept=check_layout)
    summary = export_hf(params, cfg, out_dir, dtype, max_shard_bytes=max_shard_bytes)
    summary |= {"model": meta.model_name, "step": meta.step, "checkpoint": str(Path(checkpoint_dir).absolute()),
                "weights": "checkpoint", "out": summary["path"]}
    if verify:
        summary["verified"] = verify_export(summary["path"], cfg, params, dtype)
    return summary


# The largest logit difference over the largest logit, transformers' forward against this product's
# float32 forward on the same parameters (tests/test_export_hf.py measures 2e-6 to 6e-6 in fp32 and
# 0.036 to 0.067 in bf16, as far as the model's own bf16 forward is from its fp32 one).
VERIFY_TOLERANCE = {"fp32": 1e-4, "fp16": 0.1, "bf16": 0.1}


def verify_export(folder: str | Path, cfg: TransformerConfig, params: Any, dtype: str, seed: int = 0
                  ) -> dict[str, Any]:
    """Load the export in `folder` with transformers on the CPU (in the export's dtype) and compare its
    logits at every position of 3 random sequences with this product's float32 forward on `params`:
    {"transformers", "max_abs_diff" (over the largest logit), "tolerance", "within", "top1_agreement"}.
    ImportError when transformers or torch is not installed (requirements-export.txt)."""
    # reason: optional dependencies (requirements-export.txt), needed only to verify an export
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (3, min(64, cfg.seq_len)))
    model = Decoder(cfg, dtype=np.float32, block_wrap=no_wrap, rngs=nnx.Rngs(0))
    nnx.update(model, params)
    ours = np.asarray(jax.jit(lambda m, t: m(t))(model, tokens.astype(np.int32)), np.float32)
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch_dtype).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.float().numpy()
    diff = float(np.abs(ours - theirs).max() / np.abs(ours).max())
    return {"transformers": transformers.__version__, "max_abs_diff": diff, "tolerance": VERIFY_TOLERANCE[dtype],
            "within": diff <= VERIFY_TOLERANCE[dtype],
            "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).mean())}


def _dtype(dtype: str) -> tuple[Any, str]:
    if dtype not in DTYPES:
        raise ConfigError("dtype", f"must be one of {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def _by_path(state: Any) -> dict[str, Any]:
    """The leaves of a model's parameters (a Decoder, its nnx.State, or a pure dict) by dotted path
    ("blocks.attn.q.kernel")."""
    if isinstance(state, nnx.Module):
        state = nnx.state(state, nnx.Param)
    if isinstance(state, nnx.State):
        state = state.to_pure_dict()
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path):
            leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf for path, leaf in leaves}


def _flat_params(state: Any) -> dict[str, np.ndarray]:
    """The parameters by dotted path as host arrays (gathered from their devices)."""
    return {k: np.asarray(jax.device_get(v)) for k, v in _by_path(state).items()}


def _abstract_params(cfg: TransformerConfig) -> nnx.State:
    """The shapes and dtypes of a Decoder's parameters, nothing allocated."""
    model = nnx.eval_shape(lambda: Decoder(cfg, dtype=np.float32, block_wrap=no_wrap, rngs=nnx.Rngs(0)))
    return nnx.state(model, nnx.Param)


def _check_shapes(cfg: TransformerConfig, params: dict[str, np.ndarray]) -> None:
    """ConfigError("model", ...) unless `params` are those of a Decoder of `cfg`."""
    expected = {k: tuple(v.shape) for k, v in _by_path(_abstract_params(cfg)).items()}
    got = {k: tuple(v.shape) for k, v in params.items()}
    if got != expected:
        diff = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
        shown = ", ".join(f"{k} {got.get(k, 'missing')} (expected {expected.get(k, 'none')})" for k in diff[:3])
        raise ConfigError("model", f"the parameters are not those of the config: {shown}")


def _shards(tensors: dict[str, np.ndarray], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped in order into files of at most `max_bytes` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += t.nbytes
    return shards


def _export_folder(out: Path) -> tuple[Path, list[Path]]:
    """`out` as an absolute path and the files of an earlier export in it (to replace); ConfigError
    ("out", ...) when it is a file or holds anything else. Changes nothing."""
    out = out.absolute()
    if out.exists() and not out.is_dir():
        raise ConfigError("out", f"{out} is a file; allowed: a new or empty folder, or an earlier export")
    present = list(out.iterdir()) if out.exists() else []
    ours = {CONFIG_FILE, SINGLE_FILE, INDEX_FILE}
    others = sorted(p.name for p in present if not (p.name in ours or (p.name.startswith("model-")
                                                                       and p.name.endswith(".safetensors"))))
    if others:
        raise ConfigError("out", f"{out} holds other files ({', '.join(others[:3])}); allowed: a new or empty "
                                 "folder, or an earlier export (replaced)")
    return out, present
