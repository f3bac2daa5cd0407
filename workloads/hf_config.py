"""A Hugging Face `config.json` as the decoder it describes (see workloads/configs.py).

Dense decoders: Llama, Mistral, Qwen2 and Qwen3, Gemma 1 to 3 (the text decoder) on the modern layout
(`llama` family), GPT-2 on its own (`transformer`). The keys follow `transformers`' config classes
(`hidden_size`, `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `intermediate_size`,
`head_dim`, `vocab_size`, `max_position_embeddings`, `rope_theta`, `rope_scaling`, `rms_norm_eps`,
`tie_word_embeddings`; GPT-2's `n_embd`, `n_layer`, `n_head`, `n_positions`, `n_inner`). What a family
has that the decoder here does not (Qwen2's query, key and value biases, Qwen3's and Gemma 3's query and
key norms, Gemma 2's extra norms around each block) is counted in parameters and listed. A config.json
does not say the training sequence: the plan trains at `max_position_embeddings` up to 4,096 tokens
unless given another, and serves the whole context.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from workloads.config_keys import DEFAULT_SEQ, ConfigFileError, Imported, Reader, listed, short

MODERN = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "gemma3")
GPT2 = ("gpt2",)
# Mixture-of-experts families read as the `moe` workload (the preset whose layout each starts from), and those
# not planned here.
MOE_READ = {"mixtral": "mixtral-8x7b", "qwen3_moe": "qwen3-30b-a3b", "deepseek_v2": "deepseek-v2-lite",
            "deepseek_v3": "deepseek-v3"}
MOE_TYPES = ("qwen2_moe", "llama4", "llama4_text", "dbrx", "olmoe", "jamba", "phimoe", "granitemoe", "gpt_oss",
             "glm4_moe", "ernie4_5_moe", "minimax")
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# Keys that bear on neither memory nor step time (token ids, versions, initialisation, dropout at 0).
NO_BEARING = frozenset({
    "architectures", "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version", "use_cache",
    "initializer_range", "torch_dtype", "dtype", "attention_dropout", "pretraining_tp", "_name_or_path",
    "tokenizer_class", "embd_pdrop", "attn_pdrop", "resid_pdrop", "summary_activation", "summary_first_dropout",
    "summary_proj_to_labels", "summary_type", "summary_use_proj", "task_specific_params", "max_window_layers",
    "use_sliding_window", "scale_attn_weights", "reorder_and_upcast_attn", "scale_attn_by_inverse_layer_idx",
    "n_ctx", "output_attentions", "output_hidden_states", "return_dict", "is_decoder", "image_token_index",
    "boi_token_index", "eoi_token_index", "mm_tokens_per_image", "initializer_factor", "rope_local_base_freq",
    "cache_implementation", "use_bidirectional_attention", "layer_types", "sliding_window_pattern",
    "output_router_logits", "ep_size", "seq_aux",
})


def read_hf(data: Mapping[str, Any]) -> Imported:
    r = Reader(data, "config.json")
    model_type = r.str("model_type", "")
    if not model_type:
        raise ConfigFileError("config.json has no model_type: give the config.json of a Hugging Face model")
    if model_type in MOE_READ:
        return _modern(r, model_type, [])
    _refuse_experts(data, model_type)
    if model_type in MOE_TYPES:
        raise ConfigFileError(f"config.json model_type={model_type}: a mixture-of-experts family not read here; the "
                              f"mixture-of-experts families read are {', '.join(MOE_READ)}")
    if model_type in GPT2:
        return _gpt2(r)
    if model_type not in MODERN:
        raise ConfigFileError(f"config.json model_type={model_type!r}: the readers know {', '.join(MODERN + GPT2)} "
                              "(a model of another family: bring its code, see docs/your-model.md)")
    notes: list[str] = []
    if model_type == "gemma3" and "text_config" in data:
        if not isinstance(data["text_config"], dict):
            raise ConfigFileError(f"config.json text_config: expected an object, got {short(data['text_config'])}")
        _refuse_experts(data["text_config"], model_type)
        r.raw("text_config")
        for key in ("vision_config",):
            if key in data:
                r.raw(key)
                notes.append(f"{key}: the vision encoder is not modelled; the plan is the text decoder's")
        outer = r
        r = Reader(data["text_config"], "config.json text_config")
        r.used.add("model_type")
        imported = _modern(r, "gemma3_text", notes)
        return _with_unused(imported, outer, data, prefix="")
    return _modern(r, "gemma3_text" if model_type == "gemma3" else model_type, notes)


def _refuse_experts(data: Mapping[str, Any], model_type: str) -> None:
    for key in MOE_KEYS:
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1:
            raise ConfigFileError(f"config.json {key}={short(value)}: a mixture-of-experts model ({model_type}); "
                                  f"the mixture-of-experts families read here are {', '.join(MOE_READ)}")


def _activation(r: Reader, family: str) -> str:
    """The gated MLP's activation: SiLU (SwiGLU) or GELU, exact or tanh-approximated (GeGLU)."""
    acts = {k: r.str(k) for k in ("hidden_act", "hidden_activation") if r.has(k)}
    for key, act in acts.items():
        if act not in ("silu", "swish") and not act.startswith("gelu"):
            raise ConfigFileError(f"config.json {key}={act!r}: the {family} family here computes a gated SiLU or "
                                  "GELU MLP")
    return "geglu" if any(a.startswith("gelu") for a in acts.values()) else "swiglu"


def _modern(r: Reader, model_type: str, notes: list[str]) -> Imported:
    d, layers = r.int("hidden_size", lo=8), r.int("num_hidden_layers")
    heads = r.int("num_attention_heads")
    kv = r.int("num_key_value_heads", heads)
    ff, vocab = r.int("intermediate_size"), r.int("vocab_size")
    gemma = model_type.startswith("gemma")
    # transformers' defaults: Gemma's heads are 256 wide, Qwen3's 128, the others d_model / heads
    head = r.int("head_dim", 256 if gemma else 128 if model_type in ("qwen3", "qwen3_moe") else
                 (d // heads if d % heads == 0 else None), hi=1024)
    context = r.int("max_position_embeddings", DEFAULT_SEQ, hi=1_048_576)
    seq = min(context, DEFAULT_SEQ)
    if heads % kv:
        raise ConfigFileError(f"config.json num_key_value_heads={kv}: must divide num_attention_heads={heads}")
    model: dict[str, Any] = {
        "vocab_size": vocab, "seq_len": seq, "d_model": d, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv,
        "d_ff": ff, "head_size": 0 if head * heads == d else head, "context": context if context > seq else 0,
        "tied_embeddings": r.bool("tie_word_embeddings", gemma),
        "rope_theta": _rope_theta(r, 1e6 if model_type == "gemma3_text" else 10000.0),
        "norm_eps": r.number("rms_norm_eps", 1e-6, lo=1e-12, hi=0.1),
        "rope_scaling": 1.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
        "rope_original_context": 8192,
    }
    if context > seq:
        notes.append(f"max_position_embeddings={context}: trained here at {seq:,} tokens a sequence (a config.json "
                     f"does not say the training length; --seq sets yours); served up to {context:,}")
    model["mlp"] = _activation(r, model_type)
    _rope_scaling(r, model, notes)
    missing = _missing(r, model_type, model, head, notes)
    if gemma:
        notes.append("Gemma scales embeddings by sqrt(hidden_size) and norms by (1 + weight): no bearing on memory "
                     "or step time")
    _attention_notes(r, seq, notes)
    family, preset = "llama", "8b"
    if model_type in MOE_READ:
        model.update(_experts(r, model_type, notes))
        family, preset = "moe", MOE_READ[model_type]
    imported = Imported("Hugging Face config.json", model_type, family, preset, model, {}, tuple(notes), missing)
    return _with_unused(imported, r, r.data)


def _missing(r: Reader, model_type: str, model: dict[str, Any], head: int, notes: list[str]) -> int:
    """Parameters the family has and the decoder here lacks, counted and listed in `notes`."""
    layers, d, ff = model["n_layers"], model["d_model"], model["d_ff"]
    q, kvw = model["n_heads"] * head, model["n_kv_heads"] * head
    missing, parts = 0, []
    if model_type == "qwen2" or r.bool("attention_bias", False):
        per = q + 2 * kvw + (d if model_type != "qwen2" else 0)
        missing += layers * per
        parts.append(f"attention biases ({'q, k, v' if model_type == 'qwen2' else 'q, k, v, o'}: {layers * per:,})")
    if r.bool("mlp_bias", False):
        missing += layers * (2 * ff + d)
        parts.append(f"MLP biases ({layers * (2 * ff + d):,})")
    if model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
        missing += layers * 2 * head
        parts.append(f"query and key norms ({layers * 2 * head:,})")
    if model_type in ("gemma2", "gemma3_text"):
        missing += layers * 2 * d
        parts.append(f"the norms after attention and after the MLP ({layers * 2 * d:,})")
    if parts:
        notes.append(f"{model_type} has {missing:,} parameters the decoder here does not: {'; '.join(parts)}; "
                     "planned without them")
    return missing


def _experts(r: Reader, model_type: str, notes: list[str]) -> dict[str, Any]:
    """The `moe` workload's fields from a mixture-of-experts family's keys (transformers' config classes):
    routed experts, top-k, their width, shared experts, the dense layers first, the router (softmax or sigmoid,
    renormalised or not, scaled), its load-balancing coefficient, and DeepSeek's multi-head latent attention.
    Hugging Face's implementations compute every routed slot (dropless)."""
    deepseek = model_type.startswith("deepseek")
    experts = r.int("n_routed_experts" if deepseek else "num_local_experts" if model_type == "mixtral" else
                    "num_experts", hi=1024)
    out: dict[str, Any] = {"n_experts": experts, "top_k": r.int("num_experts_per_tok", hi=64), "dispatch": "dropless"}
    if model_type == "mixtral":
        out.update(expert_d_ff=r.int("intermediate_size"), router_topk_norm=True,
                   aux_loss=r.number("router_aux_loss_coef", 0.02, lo=0, hi=10))
        return out
    out["expert_d_ff"] = r.int("moe_intermediate_size")
    if model_type == "qwen3_moe":
        dense = r.raw("mlp_only_layers") or []
        step = r.int("decoder_sparse_step", 1, hi=64)
        if dense or step != 1:
            raise ConfigFileError(f"config.json mlp_only_layers={short(dense)} decoder_sparse_step={step}: the MoE "
                                  "decoder here has its dense layers first and MoE every n-th after them")
        out.update(router_topk_norm=r.bool("norm_topk_prob", True),
                   aux_loss=r.number("router_aux_loss_coef", 0.001, lo=0, hi=10))
        return out
    score = r.str("scoring_func", "softmax")
    if score not in ("softmax", "sigmoid"):
        raise ConfigFileError(f"config.json scoring_func={score!r}: the router here scores by softmax or sigmoid")
    method = r.str("topk_method", "greedy")
    if method != "greedy":
        groups = {k: r.raw(k) for k in ("n_group", "topk_group") if r.has(k)}
        notes.append(f"topk_method={method} {short(groups)}: routed as a plain top-k over every expert (the same "
                     "FLOPs; the group limit only narrows which experts a token may reach)")
    if r.has("num_nextn_predict_layers") and r.int("num_nextn_predict_layers", lo=0, hi=64):
        notes.append(f"num_nextn_predict_layers={r.int('num_nextn_predict_layers', lo=0, hi=64)}: the multi-token "
                     "prediction module is not part of the planned model (its parameters and FLOPs left out)")
    if r.has("quantization_config"):
        notes.append(f"quantization_config={short(r.raw('quantization_config'))}: the checkpoint's stored format; "
                     "training is planned at the plan's precision with float32 master weights")
    out.update(n_shared_experts=r.int("n_shared_experts", 0, lo=0, hi=64),
               first_dense=r.int("first_k_dense_replace", 0, lo=0), moe_period=r.int("moe_layer_freq", 1, hi=64),
               router_score=score, router_scale=r.number("routed_scaling_factor", 1.0, lo=0.001, hi=1000),
               router_topk_norm=r.bool("norm_topk_prob", False),
               aux_loss=r.number("aux_loss_alpha", 0.001, lo=0, hi=10),
               attention_type="mla", q_lora_rank=r.int("q_lora_rank", 0, lo=0) if r.raw("q_lora_rank") else 0,
               kv_lora_rank=r.int("kv_lora_rank"), qk_nope_head_dim=r.int("qk_nope_head_dim"),
               qk_rope_head_dim=r.int("qk_rope_head_dim"), v_head_dim=r.int("v_head_dim"), head_size=0,
               attention="xla")
    return out


def _attention_notes(r: Reader, seq: int, notes: list[str]) -> None:
    """Soft caps and sliding windows: what the plan computes instead."""
    cap = [k for k in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar") if r.has(k)]
    for key in cap:
        r.raw(key)
    note = listed(cap, r.data, "elementwise changes to scores and logits: no bearing on memory or step time")
    if note:
        notes.append(note)
    if r.has("sliding_window"):
        window = r.int("sliding_window", lo=0, hi=10**8)
        if r.has("use_sliding_window") and not r.bool("use_sliding_window"):
            notes.append(f"sliding_window={window} with use_sliding_window=false: no window; full causal attention")
        elif window:
            notes.append(f"sliding_window={window}: planned as full causal attention over the sequence "
                         + ("(the same at this length)" if window >= seq else
                            f"(more attention FLOPs and memory than a {window:,}-token window needs)"))


def _rope_theta(r: Reader, default: float) -> float:
    """`rope_theta`, or (newer transformers) `rope_parameters.rope_theta`."""
    params = r.data.get("rope_parameters")
    if not r.has("rope_theta") and isinstance(params, dict) and "rope_theta" in params:
        return Reader(params, "config.json rope_parameters").number("rope_theta", lo=1, hi=1e9)
    return r.number("rope_theta", default, lo=1, hi=1e9)


def _rope_scaling(r: Reader, model: dict[str, Any], notes: list[str]) -> None:
    scaling = r.raw("rope_scaling") or r.raw("rope_parameters")
    if not scaling:
        return
    if not isinstance(scaling, dict):
        raise ConfigFileError(f"config.json rope_scaling: expected an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        sub = Reader(scaling, "config.json rope_scaling")
        model.update(rope_scaling=sub.number("factor", lo=1, hi=1024),
                     rope_low_freq_factor=sub.number("low_freq_factor", 1.0, lo=0.01, hi=1000),
                     rope_high_freq_factor=sub.number("high_freq_factor", 4.0, lo=0.01, hi=1000),
                     rope_original_context=sub.int("original_max_position_embeddings", 8192, hi=1_048_576))
    elif kind not in ("default", None):
        notes.append(f"rope_scaling={short(scaling)}: positions only, no bearing on memory or step time; planned "
                     "with unscaled rotary positions")


def _gpt2(r: Reader) -> Imported:
    d, layers, heads = r.int("n_embd", lo=8), r.int("n_layer"), r.int("n_head")
    seq = r.int("n_positions", 1024, hi=131072)
    notes = []
    act = r.str("activation_function", "gelu_new")
    if not act.startswith("gelu"):
        raise ConfigFileError(f"config.json activation_function={act!r}: the GPT-2 family here computes GELU")
    if act != "gelu":
        notes.append(f"activation_function={act}: computed as GELU (the same FLOPs)")
    model = {"vocab_size": r.int("vocab_size"), "seq_len": seq, "d_model": d, "n_layers": layers, "n_heads": heads,
             "n_kv_heads": heads, "d_ff": r.int("n_inner", 4 * d),
             "tied_embeddings": r.bool("tie_word_embeddings", True),
             "norm_eps": r.number("layer_norm_epsilon", 1e-5, lo=1e-12, hi=0.1)}
    return _with_unused(Imported("Hugging Face config.json", "gpt2", "transformer", "gpt2-small", model, {},
                                 tuple(notes)), r, r.data)


def _with_unused(imported: Imported, r: Reader, data: Mapping[str, Any], prefix: str = "") -> Imported:
    unused = r.unused()
    quiet = [k for k in unused if k in NO_BEARING or k.endswith("_token_id") or k.startswith("summary_")
             or data[k] is None]
    rest = [k for k in unused if k not in quiet]
    notes = list(imported.notes)
    for keys, why in ((quiet, "read, no bearing on memory or step time"),
                      (rest, "not known to this reader: not modelled")):
        note = listed(keys, data, why)
        if note:
            notes.append(prefix + note)
    return Imported(imported.format, imported.name, imported.workload, imported.preset, imported.model,
                    imported.settings, tuple(notes), imported.missing_params)
