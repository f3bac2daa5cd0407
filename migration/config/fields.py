"""The Migrate form's fields, in one table: each field once, with its type, default, allowed range or
choices, help text and place. The app's form and API (`ui/`), the command line (`migration/cli/`)
and validation (`migration/config/forms.py`) are all built from `FIELDS`, so a new field is one line
here.

- `name`: the API parameter, and (dashes for underscores, or `flag`) the command-line flag.
- `fills`: the plan request, the run config, the run options (extra runs), the autotune settings
  or the job (label, checkpoints); `to`: which field there (default: `name`), the name refusals give.
- `endpoints`: the app's API endpoints that take it. An endpoint's positional parameters are its
  fields in `FIELDS` order, so a new field goes at the end.
- `commands`: the command-line subcommands that take it as a flag.
- `section`: the form's row it sits in (the UI lays the rows out).

No JAX here: the catalog choices that need the workloads (which import JAX) are functions, called
when a form is built or a value checked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from migration.config.limits import GRANULARITIES, LIMITS, MOMENT_DTYPES, PLAN_LIMITS, PRECISIONS, REMAT_NAMES, SHARDINGS
from migration.hardware import GPU_SPECS, TPU_SPECS

# "layout": a layout name (migration/config/layouts.py) or auto; `choices` are suggestions, not a list.
# "prices": key=dollars pairs (migration/prices.py).
Kind = Literal["int", "float", "choice", "bool", "text", "folder", "layout", "prices"]
# What a field fills: the plan request, the run config, the run options (extra runs), the autotune
# settings, or the job itself (its label, its checkpoints).
Fills = Literal["plan", "run", "options", "autotune", "job"]
Choices = tuple[str, ...] | Callable[[], tuple[str, ...]]
Limits = tuple[float, float] | Callable[[], tuple[float, float]]
LABEL_MAX_CHARS = 80


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    kind: Kind
    fills: Fills
    default: Any
    label: str
    section: str = ""  # the form's row; "" for a command-line-only field
    endpoints: tuple[str, ...] = ("plan", "run")
    commands: tuple[str, ...] = ("plan",)
    help: str = ""  # the command line's help (the form shows `label`)
    limits: Limits | None = None  # int, float: inclusive
    choices: Choices = ()
    zero: str = ""  # an int that also takes 0, and what 0 means ("chosen by the planner")
    to: str = ""
    flag: str = ""
    step: float | None = None  # the form's increment for a number
    placeholder: str = ""

    @property
    def target(self) -> str:
        """The request, run config or run options field it fills; refusals name it."""
        return self.to or self.name

    @property
    def cli_flag(self) -> str:
        return "--" + (self.flag or self.name.replace("_", "-"))

    def allowed(self) -> tuple[str, ...]:
        return self.choices() if callable(self.choices) else self.choices

    def bounds(self) -> tuple[float, float]:
        lo, hi = self.limits() if callable(self.limits) else self.limits
        return (0 if self.zero else lo), hi


def workload_names() -> tuple[str, ...]:
    # reason: the workloads import JAX (not its backend): only when a form is built or checked
    from workloads import WORKLOADS

    return tuple(WORKLOADS)


def preset_names() -> tuple[str, ...]:
    """The presets of the form's default workload (the form offers the chosen workload's)."""
    # reason: the workloads import JAX (see workload_names)
    from workloads import WORKLOADS

    return tuple(WORKLOADS[FIELD["workload"].default].presets)


def dimension_limits(field: str) -> Callable[[], tuple[float, float]]:
    def limits() -> tuple[float, float]:
        # reason: the workloads import JAX (see workload_names)
        from workloads.transformer import DIM_LIMITS

        return DIM_LIMITS[field]

    return limits


AUTO = "auto"  # a choice the planner makes
PRESET = "the preset's"
EMBEDDINGS = ("preset", "tied", "untied")
DIMENSIONS = {"n_layers": ("Layers", "layers"), "d_model": ("d_model", "d-model"), "n_heads": ("Heads", "heads"),
              "n_kv_heads": ("KV heads (grouped-query when fewer)", "kv-heads"), "d_ff": ("d_ff (MLP hidden)", "d-ff"),
              "vocab_size": ("Vocabulary", "vocab"), "seq_len": ("Sequence length", "seq")}


def dimension(name: str, section: str) -> Field:
    label, flag = DIMENSIONS[name]
    return Field(name, "int", "plan", 0, label, section, commands=MODEL, limits=dimension_limits(name), zero=PRESET,
                 flag=flag,
                 help=f"{name} of your model (0 or absent: the preset's; transformer and llama)")


RUN = ("run",)
MODEL = ("plan", "run")  # the model's fields: both commands name a model
FIELDS: tuple[Field, ...] = (
    Field("steps", "int", "run", 20, "Steps", "target", RUN, RUN, limits=LIMITS["steps"], help="training steps"),
    Field("learning_rate", "float", "run", 3e-3, "Learning rate", "choices", RUN, RUN,
          limits=LIMITS["learning_rate"], flag="lr", help="the optimizer's learning rate"),
    Field("compare_tpu", "bool", "options", False, "Also run the TPU-style setup here (loss comparison)",
          "extra runs", RUN, RUN, to="tpu_style", flag="tpu-style",
          help="with --plan: also run the unchanged TPU-style setup here"),
    Field("profile", "bool", "options", False, "Capture a profile (3 extra steps under jax.profiler.trace)",
          "extra runs", RUN, RUN, help="with --plan: capture a profile of 3 extra steps"),
    Field("fp32_reference", "bool", "options", False, "Also run an fp32 reference (numerics check)",
          "extra runs", RUN, RUN, help="with --plan: also run an fp32 reference (numerics)"),
    Field("pmap_before", "bool", "options", False,
          "Also run the TPU-era pmap step (before vs after: same loss, throughput of each)", "extra runs", RUN, RUN,
          help="with --plan: also run the TPU-era pmap step on the same devices and data (loss, throughput)"),
    Field("scaling", "bool", "options", False, "Also measure scaling: both steps at 1, 2, 4, 8 devices",
          "extra runs", RUN, RUN,
          help="with --plan: also run both steps at 1, 2, 4, 8 devices (as many as this machine has)"),
    Field("workload", "choice", "plan", "transformer", "Workload", "source", commands=MODEL, choices=workload_names,
          help="a registered workload (mlp, cnn, transformer, llama, or a team's), or package.module:NAME"),
    Field("preset", "choice", "plan", "tiny", "Preset", "source", commands=MODEL, choices=preset_names,
          help="size preset of the workload (default tiny; with dimension flags, the family's full-size layout they "
               "change: llama 8b, transformer gpt2-small)"),
    Field("source", "choice", "plan", "tpu-v5e-8", "TPU source (a slice, e.g. v5p-1024, or N of them: 2xv6e-256)",
          "source", choices=tuple(TPU_SPECS),
          help="TPU source: the slice as Google Cloud names it (v5p-1024, v5litepod-256, v6e-256, tpu7x-128), a catalog "
               "key (tpu-v5p-1024), or N slices of one joined by the data-centre network (2xv6e-256, 4xv5p-512)"),
    Field("global_batch", "int", "plan", 256, "Global batch", "target", limits=PLAN_LIMITS["global_batch"],
          help="the TPU job's global batch, kept on the GPUs"),
    Field("per_core_batch", "int", "plan", 0, "Per-core batch (0: global / cores)", "target",
          limits=PLAN_LIMITS["per_core_batch"], zero="global batch / the TPU's cores",
          help="the TPU setup's per-core batch (0 or absent: global batch / TPU devices)"),
    Field("source_precision", "choice", "plan", "bf16", "TPU precision", "source", choices=("bf16", "fp32")),
    Field("target", "choice", "plan", "h100-sxm", "Target GPU", "target", choices=("local", *GPU_SPECS),
          help=f"GPU target: local, {', '.join(GPU_SPECS)}"),
    Field("gpus", "int", "plan", 1, "GPUs", "target", limits=PLAN_LIMITS["gpus"],
          help="GPUs of the target in all (more than --gpus-per-node: several nodes)"),
    Field("memory_fraction", "float", "plan", 0.8, "GPU memory share (0.05 to 1)", "target",
          limits=PLAN_LIMITS["memory_fraction"], flag="mem-fraction", step=0.05,
          help="share of each GPU the job may use"),
    Field("granularity", "choice", "plan", "multiple8", "Batch sizes", "choices", choices=GRANULARITIES,
          help="per-device batch as a multiple of 8 or a power of two"),
    Field("remat", "choice", "plan", AUTO, "Remat policy", "choices", choices=(AUTO, *REMAT_NAMES),
          help="override the remat decision (auto: the cheapest policy that fits)"),
    Field("precision", "choice", "plan", AUTO, "Precision", "choices", choices=(AUTO, *PRECISIONS),
          help="override the precision decision (auto: bf16 where native, else fp16 with loss scaling)"),
    Field("accumulation", "int", "plan", 0, "Accumulation steps (0: auto)", "choices",
          limits=LIMITS["accumulation_steps"], zero="chosen by the planner", to="accumulation_steps", flag="accum",
          help="override the accumulation steps (0 or absent: chosen by the planner)"),
    *(dimension(name, "model") for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff")),
    *(dimension(name, "nodes") for name in ("vocab_size", "seq_len")),
    Field("embeddings", "choice", "plan", "preset", "Embeddings", "nodes", commands=MODEL, choices=EMBEDDINGS,
          help="tied: the output projection shares the input embedding; untied: a separate one"),
    Field("sharding", "layout", "plan", AUTO, "Layout (auto: the fastest that fits)", "nodes",
          choices=(AUTO, *SHARDINGS, "hybrid:8", "hybrid:16", "fsdp+tp2", "hybrid:8+tp2"),
          help="override the layout: replicated, fsdp (over every GPU), hybrid:G (FSDP over groups of G GPUs, data "
               "parallelism across them), each optionally +tpT (tensor parallelism over T GPUs of a node)"),
    Field("gpus_per_node", "int", "plan", 8, "GPUs per node (GPUs above it: several nodes)", "nodes",
          limits=PLAN_LIMITS["gpus_per_node"], help="GPUs per node"),
    Field("top", "int", "autotune", 3, "Autotune: ranked choices to measure (1 to 10)", "autotune",
          ("autotune",), ("autotune",), limits=(1, 10),
          help="ranked choices to measure, those that keep the global batch"),
    Field("timed_steps", "int", "autotune", 5, "Autotune: timed steps each (after 2 warm-up steps)", "autotune",
          ("autotune",), ("autotune",), limits=(1, LIMITS["steps"][1] - 2), flag="steps",
          help="timed steps per choice; the median is its step time"),
    Field("label", "text", "job", "", "Label (shown in the History)", "job", ("plan", "run", "autotune"), ()),
    Field("save_checkpoint", "folder", "job", "", "Save a checkpoint after the run (folder)", "checkpoint", RUN, (),
          placeholder="a name, like run-1"),
    Field("restore_checkpoint", "folder", "job", "", "Start from a checkpoint (folder)", "checkpoint", RUN, (),
          placeholder="the name it was saved under"),
    # Command-line only: the planner's finer settings.
    Field("source_sharding", "choice", "plan", AUTO, "", endpoints=(), choices=(AUTO, *SHARDINGS),
          help="how the TPU job held its state (auto: replicated if it fits a chip, else fsdp)"),
    Field("source_remat", "text", "plan", "none", "", endpoints=(), flag="tpu-remat",
          help="the TPU job's remat policy, as MaxText names it (minimal, save_dot_except_mlp, save_qkv_proj, "
               "qkv_proj_offloaded, minimal_offloaded, full, ...), as this product does (dots_no_batch, ...) or "
               "custom:NAME=device|offload,... (NAME: decoder_layer_input, query_proj, kv_proj, attention_out, "
               "attention_proj, mlp_hidden, mlp_out; the rest recomputed); default none, as a TPU-era script runs"),
    Field("source_dcn_fsdp", "bool", "plan", False, "", endpoints=(), flag="tpu-fsdp-across-slices",
          help="over several slices, the TPU job shards its state over every slice (MaxText's dcn_fsdp_parallelism) "
               "rather than inside each with data parallelism across them"),
    Field("source_tensor", "int", "plan", 1, "", endpoints=(), limits=PLAN_LIMITS["source_tensor"], flag="tpu-tensor",
          help="tensor parallelism inside each slice of the TPU job (MaxText's ici_tensor_parallelism): each "
               "layer's weights and the residual stream's embedding split over this many chips, FSDP over the rest; "
               "a power of two dividing the slice's devices; 1: none"),
    Field("source_expert", "int", "plan", 1, "", endpoints=(), limits=PLAN_LIMITS["source_expert"], flag="tpu-expert",
          help="expert parallelism inside each slice of the TPU job (MaxText's ici_expert_parallelism; a "
               "mixture-of-experts model): the routed experts split over this many chips, their tokens sent by "
               "all-to-all (ragged under dropless routing); it must divide the experts and the slice's devices; 1: none"),
    Field("source_all_gathers", "bool", "plan", False, "", endpoints=(), flag="tpu-prefer-all-gather",
          help="the TPU job runs libtpu with --xla_tpu_prefer_async_allgather_to_allreduce=true (Google's TPU7x "
               "recipes for DeepSeek-V3 and Llama 3.1 405B do): the weight gathers the default flags compile as "
               "all-reduces are timed as the all-gathers that flag makes them, half the bytes"),
    Field("safety_margin", "float", "plan", 0.1, "", endpoints=(), limits=PLAN_LIMITS["safety_margin"],
          help="share of that budget kept free"),
    Field("max_per_device_batch", "int", "plan", 1024, "", endpoints=(), limits=PLAN_LIMITS["max_per_device_batch"],
          flag="max-batch", help="the largest per-device batch the planner tries"),
    Field("plan_timeout_s", "float", "plan", 900.0, "", endpoints=(), limits=PLAN_LIMITS["timeout_s"], to="timeout_s",
          flag="timeout", help="seconds before planning is stopped"),
    Field("seed", "int", "run", 0, "Seed (initial parameters and data)", "choices", RUN, RUN, limits=LIMITS["seed"]),
    Field("network_gbps", "float", "plan", 0.0, "Network per GPU between nodes, Gb/s (0: one 400 Gb/s port)", "nodes",
          limits=PLAN_LIMITS["network_gbps"], flag="network-gbps",
          help="each GPU's network bandwidth between nodes in Gb/s, NICs per GPU x their speed (0: one 400 Gb/s "
               "InfiniBand port per GPU, as in a DGX H100)"),
    Field("attention", "choice", "plan", AUTO, "Attention your code runs (auto: cuDNN's fused kernel where it can)",
          "model", choices=(AUTO, "cudnn", "xla", "splash"),
          help="the attention kernel your code uses: xla (scores materialised, e.g. jax.nn.dot_product_attention "
               "with implementation='xla' or a hand-written softmax(q k^T) v), cudnn (the fused kernel), splash "
               "(your TPU code's Pallas splash kernel, as MaxText's: the TPU side compiles it, the GPU side plans "
               "cuDNN's); auto: the fused kernel where the chip and precision allow; transformer and llama"),
    Field("mlp", "choice", "plan", "preset", "", endpoints=(), choices=("preset", "gelu", "swiglu", "geglu", "relu",
                                                                         "squared_relu"),
          help="the MLP's activation (transformer and llama): gelu, relu or squared_relu (up, activation, down), "
               "swiglu or geglu (a gate and an up projection); preset: the preset's (GELU for transformer, SwiGLU "
               "for llama)"),
    Field("layer_loop", "choice", "plan", "scan", "How your code runs the layers", "model", choices=("scan", "unrolled"),
          flag="layer-loop",
          help="scan: one lax.scan (or nnx.scan) over stacked layers, MaxText's scan_layers; unrolled: a Python loop "
               "over the layers (Paxml's USE_REPEATED_LAYER=False): no stacked buffer of saved activations, a compile "
               "that grows with the depth; transformer and llama"),
    Field("train_tokens", "float", "plan", 1e12, "Tokens to train (1e12 = 1T; examples for mlp and cnn)", "cost",
          limits=PLAN_LIMITS["train_tokens"], flag="train-tokens",
          help="tokens (examples where the workload has no tokens) the time and cost to train are given for, "
               "e.g. 1e12"),
    Field("prices", "prices", "plan", "", "Your prices, $ per chip-hour or GPU-hour (blank: public list prices)",
          "cost", flag="price", placeholder="tpu-v5p=4.2, h100-sxm=3.99",
          help="your prices over the table's, key=dollars per chip-hour (TPU generations: tpu-v5p, ...) or "
               "GPU-hour (catalog GPUs), comma-separated, e.g. tpu-v5p=4.2,h100-sxm=3.99"),
    Field("source_slices", "int", "plan", 1, "TPU slices (multislice: data parallel over the data-centre network)",
          "source", limits=PLAN_LIMITS["source_slices"], flag="slices",
          help="slices of the TPU source the job ran on, joined by the data-centre network (MaxText's "
               "dcn_data_parallelism): the global batch is split over all their cores"),
    Field("tpu_step_ms", "float", "plan", 0.0, "Your TPU job's measured step time, ms (0: not given)", "cost",
          MODEL, MODEL, limits=LIMITS["tpu_step_ms"], zero="not given", flag="tpu-step-ms",
          help="your TPU job's measured time per optimizer step (ms) at the requested global batch: the plan "
               "checks its TPU prediction against it and uses it for the TPU side's time and cost; the run's "
               "benchmark item compares the migrated run with it"),
    Field("allow_fp8", "bool", "plan", False, "Allow fp8 (changes numerics: Linear products in fp8 where the GPU "
          "has fp8 units)", "choices", MODEL, MODEL, flag="allow-fp8",
          help="let the planner choose fp8 Linear products (per-tensor on Ada and Hopper, MXFP8 on Blackwell) "
               "where the target has fp8 units and its compiled step is faster than bf16's; off by default, "
               "since fp8 changes the numerics (run with --fp32-reference to compare the losses)"),
    Field("mu_dtype", "choice", "plan", "float32", "AdamW first moment (your job's mu_dtype)", "choices", MODEL, MODEL,
          choices=MOMENT_DTYPES, flag="mu-dtype",
          help="the dtype of AdamW's first moment in your TPU job, kept by the plan and the run (optax's and "
               "MaxText's mu_dtype): float32 (the default: 16 bytes of state a parameter) or bfloat16 (14 bytes; "
               "MaxText's large mixture-of-experts recipes set it)"),
)
FIELD = {f.name: f for f in FIELDS}


def fields_of(endpoint: str) -> tuple[Field, ...]:
    """An API endpoint's fields ("plan", "run", "autotune"), in parameter order."""
    return tuple(f for f in FIELDS if endpoint in f.endpoints)


def api_values(endpoint: str, **given: Any) -> list[Any]:
    """The positional values of an API call to `endpoint` ("plan", "run", "autotune"): each field's
    default, or the value given by name. For scripts that drive the app (benchmarks, load tests), so that
    a field added to the table never shifts their values; ValueError naming a field the endpoint lacks."""
    fields = fields_of(endpoint)
    unknown = sorted(set(given) - {f.name for f in fields})
    if unknown:
        raise ValueError(f"/{endpoint} has no field {', '.join(unknown)}")
    return [given.get(f.name, f.default) for f in fields]


def flags_of(command: str) -> tuple[Field, ...]:
    """A command-line subcommand's fields."""
    return tuple(f for f in FIELDS if command in f.commands)
