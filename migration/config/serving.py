"""A serving request: which model, on which GPU, for which requests (prompt and generation lengths,
batch sizes), checked once here. Refusals are one-line `ConfigError`s naming the field and what is
allowed; the command line (`serve-plan`) builds its request with `serve_request`."""

from __future__ import annotations

import dataclasses
from typing import Any

import os

from migration.config.checkpoints import CheckpointMeta, read_checkpoint
from migration.config.forms import choice, number, whole
from migration.config.limits import shown
from migration.common import ConfigError
from migration.hardware import GPU_SPECS

SERVE_PRECISIONS = ("bf16", "fp16", "fp32", "int8")  # int8: weight-only, bf16 compute and cache
# The KV cache's storage: "auto" in the compute dtype; "fp8" in e4m3 (half of bf16's bytes: twice the sequences
# in the same memory), written with a unit scale and read back into the compute dtype for attention
DECODER_WORKLOADS = ("transformer", "llama", "moe")  # the families with a decode path (Decoder.extend)
SERVE_LIMITS = {"prompt_len": (1, 131072), "gen_len": (1, 131072), "batch": (1, 4096), "gpus": (1, 8)}  # gpus: one node's
KV_CACHES = ("auto", "fp8")
MAX_BATCHES = 16  # batch sizes listed in one request
CHUNK = 2048  # prompt tokens and decode tokens an engine step runs at most (vLLM's max_num_batched_tokens)
CHUNK_LIMITS = (16, 65536)
MIX_CLASSES = 8  # request classes in one mix
MEMORY_FRACTION = 0.9  # of the device's memory a server may use


@dataclasses.dataclass(frozen=True)
class ServeRequest:
    workload: str  # a decoder family: "transformer" (GPT-2 layout) or "llama"
    preset: str
    target: str  # a catalog GPU key (hardware.GPU_SPECS): planned without the device
    prompt_len: int
    gen_len: int
    precision: str = "bf16"
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    batches: tuple[int, ...] = ()  # (): 1, 2, 4, ... up to the largest batch that fits, and that one
    gpus: int = 1
    memory_fraction: float = MEMORY_FRACTION
    checkpoint: str = ""  # the folder of a training checkpoint the model comes from ("" : the preset)
    kv_cache: str = "auto"  # KV_CACHES
    chunk: int = CHUNK  # the engine's token budget a step (planning/capacity.py)
    # the request mix: (share of requests, prompt tokens, generated tokens) classes, shares summing to 1;
    # () is one class of prompt_len and gen_len (which are otherwise the mix's longest prompt and generation)
    mix: tuple[tuple[float, int, int], ...] = ()

    @property
    def classes(self) -> tuple[tuple[float, int, int], ...]:
        return self.mix or ((1.0, self.prompt_len, self.gen_len),)


def parse_mix(value: Any) -> tuple[tuple[float, int, int], ...]:
    """A request mix from text: comma-separated classes `[share*]prompt:generated`, e.g. "512:128" or
    "0.7*512:128, 0.3*4096:512" (shares relative, equal when left out); "" for none. ConfigError("mix")."""
    if value in (None, "", ()):
        return ()
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    form = ("classes `[share*]prompt:generated`, comma-separated, e.g. 512:128 or 0.7*512:128, 0.3*4096:512 "
            f"(at most {MIX_CLASSES}; tokens whole numbers from 1 to {SERVE_LIMITS['prompt_len'][1]:,})")
    if not isinstance(value, str) or len(value) > 400:
        raise ConfigError("mix", f"must be text of {form}; got {shown(value)}")
    parts = [p.strip() for p in value.split(",")]
    if len(parts) > MIX_CLASSES:
        raise ConfigError("mix", f"at most {MIX_CLASSES} classes; got {len(parts)}")
    classes = []
    for part in parts:
        share_text, _, lengths = part.rpartition("*")
        prompt_text, colon, gen_text = lengths.partition(":")
        try:
            share = float(share_text) if share_text.strip() else 1.0
            prompt, gen = (whole(t.strip(), "mix", *SERVE_LIMITS[n]) for t, n in
                           ((prompt_text, "prompt_len"), (gen_text, "gen_len")))
        except (ValueError, ConfigError):
            raise ConfigError("mix", f"{shown(part)} is not a class; give {form}") from None
        if not colon or not (0 < share <= 1e6) or share != share:
            raise ConfigError("mix", f"{shown(part)} is not a class; give {form} (shares above 0)")
        classes.append((share, prompt, gen))
    total = sum(c[0] for c in classes)
    return tuple((share / total, prompt, gen) for share, prompt, gen in classes)


def format_mix(classes: tuple[tuple[float, int, int], ...]) -> str:
    """A mix as parse_mix reads it back (shares exactly, as Python writes floats)."""
    return ",".join(f"{share!r}*{prompt}:{gen}" for share, prompt, gen in classes)


def batch_list(value: Any, lo: int = SERVE_LIMITS["batch"][0], hi: int = SERVE_LIMITS["batch"][1],
               most: int = MAX_BATCHES) -> tuple[int, ...]:
    """"1,4,16" (or a list) as batch sizes, each `lo` to `hi`, at most `most` of them; "" for the default."""
    if value in (None, "", ()):
        return ()
    if not isinstance(value, (str, list, tuple)):
        raise ConfigError("batches", f"batch sizes are text or a list, comma-separated whole numbers from {lo} to "
                                     f"{hi:,} (e.g. 1,8,32); got {type(value).__name__} {str(value)[:40]!r}")
    parts = value.split(",") if isinstance(value, str) else list(value)
    if len(parts) > most:
        raise ConfigError("batches", f"at most {most} batch sizes; got {len(parts)}")
    out = []
    for part in parts:
        try:
            out.append(whole(part, "batches", lo, hi))
        except ConfigError:
            raise ConfigError("batches", f"each batch size must be a whole number from {lo} to {hi:,}, comma-separated "
                                         f"(e.g. 1,8,32); got {str(part)[:40]!r}") from None
    return tuple(sorted(set(out)))


def decoder_choices(workload: Any, preset: Any, precision: Any) -> tuple[str, str, str]:
    """A decoder family with a decode path, one of its presets and a serving precision, or ConfigError."""
    # reason: the workloads import JAX; only a serving request that is being checked needs them
    from workloads import WORKLOADS

    workload = choice(workload, "workload", list(WORKLOADS))
    if workload not in DECODER_WORKLOADS:
        raise ConfigError("workload", f"{workload} has no decode path; serving is for the decoder families "
                                      f"({', '.join(DECODER_WORKLOADS)})")
    return (workload, choice(preset, "preset", list(WORKLOADS[workload].presets)),
            choice(precision, "precision", list(SERVE_PRECISIONS)))


def model_config(workload: str, preset: str, model: dict[str, Any]) -> Any:
    """The checked family's model config with `model`'s overrides, or ConfigError naming the dimension."""
    # reason: the workloads import JAX; only a serving request that is being checked needs them
    from workloads import WORKLOADS, WorkloadError

    try:
        return WORKLOADS[workload].config(preset, model)
    except (WorkloadError, ValueError) as exc:
        raise ConfigError(getattr(exc, "field", "model"), getattr(exc, "message", str(exc))) from None


def context_source(cfg: Any) -> str:
    """Where a model's context comes from, for messages."""
    return "its published context window" if cfg.context else "seq_len, its training length"


def serving_checkpoint(path: Any, workload: Any, preset: Any) -> CheckpointMeta:
    """The description of the training checkpoint in folder `path` (absolute), whose model is served:
    a decoder family's. A workload or preset also named must be the checkpoint's (None or "" names
    none): a checkpoint serves only as the model it was saved from. ConfigError("checkpoint", ...)."""
    if not isinstance(path, str) or "\n" in path or "\0" in path or not os.path.isabs(path):
        raise ConfigError("checkpoint", f"must be the absolute path of a checkpoint folder (written by run "
                                        f"--save-checkpoint); got {shown(path)}")
    meta = read_checkpoint(path)
    if meta.workload not in DECODER_WORKLOADS:
        raise ConfigError("checkpoint", f"the checkpoint is of {meta.model_name}, which has no decode path; serving "
                                        f"is for the decoder families ({', '.join(DECODER_WORKLOADS)})")
    named = [(what, value, mine) for what, value, mine in (("workload", workload, meta.workload),
                                                          ("preset", preset, meta.preset)) if value not in (None, "")]
    if any(value != mine for _, value, mine in named):
        asked = "/".join(str(value) for _, value, _ in named)
        raise ConfigError("checkpoint", f"the checkpoint is of another model: {meta.model_name} "
                                        f"({', '.join(f'{k} {v}' for k, v in list(meta.dims.items())[:5])}), the "
                                        f"request names {shown(asked)}; a checkpoint serves only as the model it was "
                                        "saved from: name that model, or leave workload and preset empty")
    return meta


def tensor_split(cfg: Any) -> dict[str, int]:
    """What tensor parallelism divides among the GPUs: heads, kv heads (not MLA's one compressed head) and the
    MLPs' widths (an MoE model's dense layers and shared experts; its routed experts split whole where their
    number divides, else by width)."""
    split = {"attention heads": cfg.n_heads}
    if getattr(cfg, "attention_type", "gqa") != "mla":
        split["kv heads"] = cfg.n_kv_heads
    if not hasattr(cfg, "n_experts") or cfg.n_dense_layers:
        split["MLP width (d_ff)"] = cfg.d_ff
    if getattr(cfg, "n_shared_experts", 0):
        split["shared experts' width"] = cfg.n_shared_experts * cfg.expert_width
    return split


def uneven_splits(cfg: Any, gpus: int) -> list[str]:
    """What of the model does not divide among `gpus` GPUs (tensor_split; routed experts neither by number nor width)."""
    uneven = [f"{what} {n}" for what, n in tensor_split(cfg).items() if n % gpus]
    if hasattr(cfg, "n_experts") and cfg.n_experts % gpus and cfg.expert_width % gpus:
        uneven.append(f"routed experts {cfg.n_experts} (and their width {cfg.expert_width})")
    return uneven


def serve_request(*, workload: Any, preset: Any, target: Any, prompt_len: Any = None, gen_len: Any = None,
                  precision: Any = "bf16", model: dict[str, Any] | None = None, batches: Any = (), gpus: Any = 1,
                  memory_fraction: Any = MEMORY_FRACTION, checkpoint: Any = "", kv_cache: Any = "auto",
                  chunk: Any = CHUNK, mix: Any = "") -> ServeRequest:
    """A checked ServeRequest from raw values, or ConfigError naming the field: the requests are one
    class (`prompt_len`, `gen_len`) or a `mix` (parse_mix), not both. With a `checkpoint` folder, the
    model is the checkpoint's (serving_checkpoint)."""
    if checkpoint:
        meta = serving_checkpoint(checkpoint, workload, preset)
        workload, preset, model = meta.workload, meta.preset, meta.model
    workload, preset, precision = decoder_choices(workload, preset, precision)
    target = choice(target, "target", list(GPU_SPECS))
    classes = parse_mix(mix)
    if classes:
        if prompt_len not in (None, "") or gen_len not in (None, ""):
            raise ConfigError("mix", "give the requests as a mix or as one prompt and generation length, not both")
        prompt_len, gen_len = max(c[1] for c in classes), max(c[2] for c in classes)
    lengths = {name: whole(value, name, *SERVE_LIMITS[name]) for name, value in
               (("prompt_len", prompt_len), ("gen_len", gen_len))}
    gpus = whole(gpus, "gpus", *SERVE_LIMITS["gpus"])
    fraction = number(memory_fraction, "memory_fraction", 0.05, 1.0)
    cfg = model_config(workload, preset, dict(model or {}))
    uneven = uneven_splits(cfg, gpus)
    if uneven:
        fitting = [str(g) for g in range(1, SERVE_LIMITS["gpus"][1] + 1) if not uneven_splits(cfg, g)]
        raise ConfigError("gpus", f"tensor parallelism over {gpus} GPUs divides the model's heads and hidden units "
                                  f"among them; {', '.join(uneven)} do not divide by {gpus} (GPU counts that do: "
                                  f"{', '.join(fitting)})")
    total = max(p + g for _, p, g in classes) if classes else lengths["prompt_len"] + lengths["gen_len"]
    if total > cfg.max_context:
        what = (f"the mix's longest request, {total:,} tokens," if classes else
                f"prompt ({lengths['prompt_len']:,}) + generation ({lengths['gen_len']:,}) = {total:,} tokens")
        raise ConfigError("mix" if classes else "gen_len", f"{what} exceed the model's context of "
                                                           f"{cfg.max_context:,} ({context_source(cfg)})")
    kv_cache = choice(kv_cache, "kv_cache", list(KV_CACHES))
    return ServeRequest(workload, preset, target, lengths["prompt_len"], lengths["gen_len"], precision,
                        dict(model or {}), batch_list(batches), gpus, fraction, checkpoint or "", kv_cache,
                        whole(chunk, "chunk", *CHUNK_LIMITS), classes)


@dataclasses.dataclass(frozen=True)
class ServeRunRequest:
    """A measured serving stream on this machine (running/serving.py)."""
    workload: str
    preset: str
    precision: str = "fp32"
    requests: int = 50
    batches: tuple[int, ...] = (4,)  # each measured in turn
    prompt_range: tuple[int, int] = (4, 32)
    gen_range: tuple[int, int] = (4, 24)
    temperature: float = 0.0  # 0: greedy
    seed: int = 0
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    checkpoint: str = ""  # the folder of a training checkpoint whose parameters are served ("" : random ones)
    kv_cache: str = "auto"  # KV_CACHES


RUN_LIMITS = {"requests": (1, 1000), "batch": SERVE_LIMITS["batch"], "seed": (0, 2**31 - 1)}  # a plan's concurrency
RUN_BATCHES = 6  # batch sizes measured in one run


def serve_run_request(*, workload: Any, preset: Any, precision: Any = "fp32", requests: Any = 50, batches: Any = "4",
                      prompt_min: Any = 4, prompt_max: Any = 32, gen_min: Any = 4, gen_max: Any = 24,
                      temperature: Any = 0.0, seed: Any = 0, checkpoint: Any = "",
                      kv_cache: Any = "auto", model: dict[str, Any] | None = None) -> ServeRunRequest:
    """A checked ServeRunRequest from raw values, or ConfigError naming the field; `model`: dimensions
    over the preset's. With a `checkpoint` folder, the model and its parameters are the checkpoint's
    (serving_checkpoint)."""
    model = dict(model or {})
    if checkpoint:
        meta = serving_checkpoint(checkpoint, workload, preset)
        workload, preset, model = meta.workload, meta.preset, meta.model
    workload, preset, precision = decoder_choices(workload, preset, precision)
    counts = {name: whole(value, name, *RUN_LIMITS[name]) for name, value in
              (("requests", requests), ("seed", seed))}
    sizes = batch_list(batches, *RUN_LIMITS["batch"], RUN_BATCHES)
    if not sizes:
        raise ConfigError("batches", f"give one to {RUN_BATCHES} batch sizes from 1 to {RUN_LIMITS['batch'][1]:,}, "
                                     "comma-separated (e.g. 1,4,8)")
    ranges = {}
    for name, lo_value, hi_value in (("prompt_len", prompt_min, prompt_max), ("gen_len", gen_min, gen_max)):
        lo = whole(lo_value, name.replace("_len", "_min"), *SERVE_LIMITS[name])
        hi = whole(hi_value, name.replace("_len", "_max"), *SERVE_LIMITS[name])
        if lo > hi:
            raise ConfigError(name.replace("_len", "_min"), f"must be at most {name.replace('_len', '_max')} ({hi}); "
                                                            f"got {lo}")
        ranges[name] = (lo, hi)
    cfg = model_config(workload, preset, model)
    if ranges["prompt_len"][1] + ranges["gen_len"][1] > cfg.max_context:
        raise ConfigError("gen_max", f"the longest prompt ({ranges['prompt_len'][1]}) and generation "
                                     f"({ranges['gen_len'][1]}) exceed the model's context of {cfg.max_context:,} "
                                     f"({context_source(cfg)})")
    return ServeRunRequest(workload, preset, precision, counts["requests"], sizes, ranges["prompt_len"],
                           ranges["gen_len"], number(temperature, "temperature", 0.0, 10.0), counts["seed"], model,
                           checkpoint or "", choice(kv_cache, "kv_cache", list(KV_CACHES)))
