"""The rule table: each rule's id, severity, title, replacement, why it matters on GPUs, and an example
that triggers it. `rules_markdown` renders the table of the docs' rule reference (docs/reference/rules.md)."""

from __future__ import annotations

import dataclasses

SEVERITIES = ("error", "warning", "info")
MIN_REASON_WORDS = 3


@dataclasses.dataclass(frozen=True)
class Rule:
    id: str
    severity: str     # one of SEVERITIES
    title: str        # one line: what the rule finds
    replacement: str  # what to write instead (a finding may name a more precise one)
    rationale: str    # what is matched, and why it matters on GPUs
    example: str      # a short source text that triggers the rule


RULES: dict[str, Rule] = {r.id: r for r in [
    Rule("TPU001", "error", "TPU-only device selection",
         replacement="select devices without naming the platform: jax.devices() / jax.local_devices(), and place "
                     "data with jax.device_put(x, NamedSharding(mesh, P(...))); leave JAX_PLATFORMS unset (or list "
                     "the GPU platform)",
         rationale="Finds code that selects or expects the TPU: `jax.devices(\"tpu\")`, `backend=\"tpu\"`, backend "
                   "assertions such as `jax.default_backend() == \"tpu\"`, `jax_platform_name` set to `tpu` and "
                   "`JAX_PLATFORMS=tpu`. A GPU machine has no TPU platform: the call raises, the assertion fails, "
                   "or the TPU branch silently never runs.",
         example="import jax\ndevices = jax.devices(\"tpu\")\n"),
    Rule("PMAP001", "warning", "pmap (in maintenance mode)",
         replacement="jax.jit over arrays sharded with NamedSharding on a jax.make_mesh mesh (or jax.shard_map for "
                     "per-device code)",
         rationale="Finds `jax.pmap` (decorator, call or a bare `pmap` in a snippet). pmap is in maintenance mode; "
                   "it replicates parameters and optimizer state on every device by hand, which `jax.jit` over "
                   "sharded arrays does for you, and it cannot shard a state too large for one GPU's memory "
                   "(FSDP).",
         example="import jax\np_step = jax.pmap(lambda x: x * 2)\n"),
    Rule("PMAP002", "warning", "collective under pmap",
         replacement="under jit with a sharded batch, a mean over the global batch is all-reduced by XLA: drop "
                     "lax.pmean/psum, or keep them inside jax.shard_map",
         rationale="Finds `lax.pmean`, `lax.psum` and the other collectives inside a pmapped function (or in a file "
                   "that uses pmap and no shard_map). Under `jit` with a sharded batch XLA inserts the all-reduce "
                   "itself (over NCCL on GPUs); a collective that names pmap's axis fails there with an unbound "
                   "axis name.",
         example="import jax\nfrom jax import lax\n\n@jax.pmap\ndef mean_grads(g):\n"
                 "    return lax.pmean(g, \"batch\")\n"),
    Rule("PMAP003", "warning", "pmap-era placement helpers",
         replacement="jax.device_put with a NamedSharding over the mesh (P() to replicate, P('data') to split a "
                     "batch), or nothing: a sharded jax.Array is one array",
         rationale="Finds calls of the helpers that place data by hand for pmap: Flax's `jax_utils.replicate`, "
                   "`unreplicate`, `prefetch_to_device`, `pad_shard_unpad`, `common_utils.shard` and "
                   "`shard_prng_key`, jaxline's `bcast_local_devices`. They add or remove a leading device axis "
                   "and copy state to every local device; once the step is jit with shardings they must go with "
                   "pmap, or the batch arrives with an extra axis and the state as one copy per GPU.",
         example="from flax import jax_utils\nstate = jax_utils.replicate(state)\n"),
    Rule("REMOVED001", "error", "removed from JAX (absent in JAX 0.10)",
         replacement="the replacement the finding names; for device_put_replicated / device_put_sharded: "
                     "jax.device_put(x, NamedSharding(mesh, P())) to replicate, NamedSharding(mesh, P('data')) to "
                     "shard",
         rationale="Finds APIs removed from JAX (and Flax), at the import or the use: `device_put_replicated` / "
                   "`device_put_sharded`, `jax.experimental.maps`, `jax.tree_map` and the other `jax.tree_*` "
                   "aliases, `jax.experimental.optimizers`, `jax.ops.index_update`, `jax.ShapedArray`, "
                   "`jax.spmd_mode`, the old compilation cache's `initialize_cache`, `flax.optim`, `flax.nn` and "
                   "more. A GPU machine gets a "
                   "current JAX, where the script fails at the import or the first call; each finding names the "
                   "current replacement.",
         example="import jax\nparams = jax.device_put_replicated(params, jax.devices())\n"),
    Rule("TPUENV001", "warning", "TPU-only environment variables",
         replacement="drop LIBTPU_*/TPU_* settings on GPUs; their GPU counterparts are XLA_FLAGS (--xla_gpu_*), "
                     "NCCL_* and XLA_PYTHON_CLIENT_* set before `import jax`",
         rationale="Finds `LIBTPU_INIT_ARGS`, `TPU_*`, `XRT_TPU_*`, `JAX_USE_PJRT_C_API_ON_TPU` and the like, set or "
                   "read. Only libtpu and TPU VMs use them: on a GPU machine the TPU tuning they carry (scheduler "
                   "and collective flags) silently does nothing, and code that reads them gets nothing back.",
         example="import os\nos.environ[\"LIBTPU_INIT_ARGS\"] = \"--xla_tpu_enable_latency_hiding_scheduler=true\"\n"),
    Rule("GCS001", "warning", "Google Cloud Storage paths and clients",
         replacement="take paths from configuration; read and write through fsspec or etils.epath (gs:// still works "
                     "with credentials), or a path the GPU cluster mounts; Orbax checkpoints accept any epath",
         rationale="Finds `gs://` paths, `tf.io.gfile` calls and `google.cloud.storage` clients. TPU jobs keep data "
                   "and checkpoints in buckets next to the TPU; a GPU box or cluster elsewhere needs credentials, "
                   "pays egress and latency on every read, or has no route at all: the job fails at its first "
                   "checkpoint or batch, not at start-up.",
         example="import tensorflow as tf\nwith tf.io.gfile.GFile(\"gs://bucket/run/results.json\", \"w\") as f:\n"  # migration: ignore[GCS001] the rule's own example
                 "    f.write(\"{}\")\n"),
    Rule("TOPO001", "warning", "a TPU slice's device count or mesh shape written as numbers",
         replacement="derive the mesh from what is there: jax.make_mesh((jax.device_count() // model, model), "
                     "(\"data\", \"model\")), with the model axis read from configuration",
         rationale="Finds mesh shapes given as literals (`create_device_mesh((4, 2))`, `make_mesh((8, 4), ...)`), "
                   "device lists reshaped to fixed shapes, and device or core counts compared with a number "
                   "(`assert jax.device_count() == 8`, `assert cores_per_replica <= 8`). They encode a TPU slice: 8 "
                   "cores a host on v2/v3, 4 chips on v4/v5p. A GPU box has 1, 2, 4 or 8 GPUs and a cluster "
                   "multiples of its node: the reshape fails, the assertion stops the job, or the model axis spans "
                   "nodes over the slow network.",
         example="import jax\nfrom jax.experimental import mesh_utils\n"
                 "devices = mesh_utils.create_device_mesh((4, 2))\n"),
    Rule("BF16OPT001", "warning", "optimizer state or gradient accumulators in 16 bits",
         replacement="keep optimizer moments and accumulated gradients in float32 (optax's default: leave mu_dtype "
                     "unset) and cast only the forward and backward pass to bfloat16 or float16",
         rationale="Finds optax's `mu_dtype` / `nu_dtype` (and the like) set to bfloat16 or float16, and gradient "
                   "accumulators created or cast in those types. Adding many small updates in 16 bits loses them "
                   "(bfloat16 keeps 8 bits of mantissa), and float16, the type GPUs without bfloat16 use, "
                   "overflows: the loss stalls or becomes NaN after a migration that changed nothing else.",
         example="import optax\nimport jax.numpy as jnp\ntx = optax.adam(1e-3, mu_dtype=jnp.bfloat16)\n"),
    Rule("PJIT001", "error", "pjit's removed keywords in_axis_resources / out_axis_resources",
         replacement="in_shardings= / out_shardings= (NamedSharding or PartitionSpec), and jax.jit in place of pjit",
         rationale="Finds `in_axis_resources=` and `out_axis_resources=` given to `pjit` or `jax.jit` (called, or "
                   "through `functools.partial`). The keywords were renamed to `in_shardings` / `out_shardings` and "
                   "then removed: on current JAX the call raises a TypeError before anything compiles, in every "
                   "pjit-era training script.",
         example="from jax.experimental.pjit import pjit\nstep = pjit(train_step, in_axis_resources=None, "
                 "out_axis_resources=None)\n"),
    Rule("REMOVED002", "error", "jax.clear_backends was removed",
         replacement="jax.clear_caches() for compiled functions; to give GPU memory back, end the process (run each "
                     "job in its own)",
         rationale="Finds calls of `clear_backends`, which no longer exists: the call raises. Scripts used it to "
                   "release device memory between runs; on a GPU the memory JAX holds goes back when the process "
                   "ends.",
         example="import jax\njax.clear_backends()\n"),
    Rule("ENV001", "error", "JAX/XLA environment set after `import jax`",
         replacement="set XLA_*, JAX_* and CUDA_VISIBLE_DEVICES before the first `import jax` (or in the launching "
                     "shell): JAX reads them once, when it initialises",
         rationale="Finds `XLA_*`, `JAX_*`, `CUDA_VISIBLE_DEVICES`, `TF_CPP_*` and `NCCL_*` variables set after the "
                   "first `import jax` (or of a library that imports it), by assignment, `+=`, `update`, "
                   "`setdefault` or `putenv`. JAX reads them once, when it initialises: set later, they may have no "
                   "effect, and the GPU runs with the defaults (75% of its memory preallocated, every GPU visible).",
         example="import os\nimport jax\nos.environ[\"XLA_PYTHON_CLIENT_MEM_FRACTION\"] = \"0.9\"\n"),
    Rule("SYNC001", "warning", "host synchronisation in the training loop",
         replacement="keep per-step metrics on the device and fetch them every N steps (inside `if step % N == 0:`) "
                     "or after the loop; the step then never waits for the host",
         rationale="Finds reads of a step's device results on the host inside the training loop: `float(loss)`, "
                   "`.item()`, `np.asarray`, `jax.device_get`, printing, logging or formatting a device array, a "
                   "branch on one; also in a function of the file that the loop calls. A fetch every N steps is the "
                   "remedy and is not reported. JAX dispatches asynchronously: each read makes the host wait for "
                   "the step, so the GPU idles while the next one is prepared.",
         example="for batch in data:\n    state, loss = train_step(state, batch)\n    print(float(loss))\n"),
    Rule("TIME001", "warning", "timing a jitted call without block_until_ready",
         replacement="call .block_until_ready() (or jax.block_until_ready(out)) on the result before reading the "
                     "clock: JAX dispatches asynchronously",
         rationale="Finds a clock read (`time.time()`, `time.perf_counter()`, `datetime.now()`, ...) that ends a "
                   "measurement of JAX work with nothing waited for in between. A JAX call returns once its work is "
                   "dispatched, so the time measured is the dispatch, not the computation, and step times and "
                   "throughput computed from it are wrong.",
         example="import time\nt0 = time.perf_counter()\nstate = train_step(state, batch)\n"
                 "elapsed = time.perf_counter() - t0\n"),
    Rule("TRACE001", "error", "Python control flow on a traced value inside a jitted function",
         replacement="jnp.where for element-wise choices, jax.lax.cond / lax.switch for branches, lax.while_loop / "
                     "lax.fori_loop for loops; or mark the argument static (static_argnames / static_argnums)",
         rationale="Finds Python `if`, `while`, `assert`, conditional expressions and `range()` bounds on traced "
                   "values inside a function under `jit`, `vmap` or a `lax` loop, decorated or jitted by call; "
                   "`static_argnums` / `static_argnames` are honoured. Tracing has no concrete value to branch on: "
                   "the call raises a `ConcretizationTypeError`, or the branch is fixed when the function is "
                   "compiled.",
         example="import jax\n\n@jax.jit\ndef relu(x):\n    if x > 0:\n        return x\n    return 0.0 * x\n"),
    Rule("SHAPE001", "warning", "batch shapes that vary between steps",
         replacement="drop the last partial batch (drop_remainder=True / drop_last=True) or pad it to the fixed "
                     "shape with a mask: every new shape is a new compile",
         rationale="Finds `.batch(...)` / `.padded_batch(...)` without `drop_remainder=True` and torch's "
                   "`DataLoader(...)` without `drop_last=True`. The last, smaller batch has a new shape, and `jit` "
                   "compiles the step again for every new shape (seconds to minutes for a large model); a batch "
                   "that no longer divides over the GPUs cannot be sharded evenly.",
         example="ds = ds.batch(128)\n"),
    Rule("BATCH001", "warning", "hard-coded TPU-sized batch",
         replacement="size the per-device batch from the GPU's memory (python -m migration plan) and keep the "
                     "global batch with gradient accumulation",
         rationale="Finds batch sizes of 512 or more written as constants (assignments, dict entries, argparse / "
                   "absl defaults, function defaults), not counts such as `NUM_BATCHES`. A batch sized for a TPU "
                   "pod's combined memory rarely fits one GPU's: the step runs out of memory.",
         example="GLOBAL_BATCH_SIZE = 4096\n"),
    Rule("FP16001", "warning", "float16 without loss scaling",
         replacement="use bfloat16 where the GPU has it (compute capability 8.0+), or add dynamic loss scaling "
                     "(scale the loss, unscale the gradients, skip non-finite updates)",
         rationale="Finds `float16` chosen as a dtype in a file with no loss scaling. TPU code trains in bfloat16, "
                   "which has float32's range; float16's range is far narrower, so without loss scaling small "
                   "gradients underflow to zero and large values overflow to inf, and the loss stalls or turns "
                   "NaN.",
         example="import jax.numpy as jnp\nx = x.astype(jnp.float16)\n"),
    Rule("PREC001", "info", "matmul precision left to the platform default",
         replacement="state the precision the numerics need: jax.config.update('jax_default_matmul_precision', "
                     "'float32') or `with jax.default_matmul_precision('float32'):` (TPUs default to bf16 passes, "
                     "GPUs of compute capability 8.0+ to TF32), and compare results on both",
         rationale="Finds the default matmul precision set to `bfloat16`, `fastest` or `default` (config or "
                   "`JAX_DEFAULT_MATMUL_PRECISION`), `precision=` arguments asking for the default, and "
                   "`default_matmul_precision(...)` called outside a `with`. The default differs by platform: TPUs "
                   "multiply float32 matrices in bf16 passes, GPUs of compute capability 8.0+ in TF32, so results "
                   "differ from the TPU run's.",
         example="import jax\njax.config.update(\"jax_default_matmul_precision\", \"bfloat16\")\n"),
    Rule("ROUTER001", "warning", "a mixture-of-experts router scoring its experts in 16 bits",
         replacement="cast the router's logits to float32 before its softmax, sigmoid or top-k "
                     "(`jax.nn.softmax(router_logits.astype(jnp.float32))`), or compute the router's product in "
                     "float32 (`dtype=jnp.float32`, `preferred_element_type=jnp.float32`)",
         rationale="Finds a softmax, log-softmax, sigmoid or top-k over a router's logits (a name with `router` or "
                   "`routing` in it, or `gate` / `gating` inside a function or class about experts) that the code "
                   "itself puts in bfloat16 or float16: a cast or `dtype=` in the input, the input's last assignment "
                   "in the same function, or the `dtype=` of the router layer the class builds. The router's "
                   "probabilities pick each token's experts and weigh their outputs; in 16 bits close scores tie "
                   "and small ones round away, so routing and the balance loss drift from float32's (MaxText, "
                   "DeepSeek-V3 and Mixtral's reference code score in float32). Where the code says no type, nothing "
                   "is reported; the migration checklist then says it could not tell.",
         example="import jax\nimport jax.numpy as jnp\nfrom flax import linen as nn\n\n"
                 "class MoeLayer(nn.Module):\n    num_experts: int = 8\n\n    @nn.compact\n"
                 "    def __call__(self, x):\n"
                 "        router_logits = nn.Dense(self.num_experts, dtype=jnp.bfloat16)(x)\n"
                 "        weights, experts = jax.lax.top_k(jax.nn.softmax(router_logits), 2)\n"
                 "        return weights, experts\n"),
    Rule("ATTN001", "info", "attention that stores the scores (XLA's)",
         replacement="jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation='cudnn') in bf16 or fp16 "
                     "(head size a multiple of 8 up to 128); plan with --attention xla to see what it saves",
         rationale="Finds a softmax over a product of two arrays (`softmax(einsum(q, k) / sqrt(d))`, `softmax(q @ "
                   "k.T)`, or over a variable assigned such a product in the same function), "
                   "`jax.nn.dot_product_attention(..., implementation=\"xla\")` and Flax's "
                   "`dot_product_attention`. They compute the T x T attention scores per head in HBM, which at long "
                   "sequences makes the step memory-bound and its peak grow with T squared; on NVIDIA GPUs of "
                   "compute capability 8.0+ cuDNN's fused kernel never stores them. The planner plans such code "
                   "with XLA's attention and names the saving.",
         example="import jax\nimport jax.numpy as jnp\n\ndef attend(q, k, v):\n"
                 "    scores = jnp.einsum(\"bqhd,bkhd->bhqk\", q, k)\n"
                 "    return jnp.einsum(\"bhqk,bkhd->bqhd\", jax.nn.softmax(scores, axis=-1), v)\n"),
    Rule("IGNORE001", "info", "ignore comment without a reason",
         replacement=f"say why the finding stays, after the rule list: `# migration: ignore[RULE] reason` with at "
                     f"least {MIN_REASON_WORDS} words",
         rationale=f"Finds `# migration: ignore[...]` comments without a reason of at least {MIN_REASON_WORDS} "
                   "words, or that name no known rule. Such a comment silences nothing, so the finding it was "
                   "meant for is still reported; the reason tells whoever reads the code why it stays.",
         example="import jax\ndevices = jax.devices(\"tpu\")  # migration: ignore[TPU001]\n"),
]}


def rules_markdown() -> str:
    """The rule table as Markdown, one row per rule in table order (docs/reference/rules.md shows it verbatim)."""
    rows = ["| Rule | Severity | What it finds and why it matters |", "| --- | --- | --- |"]
    for rule in RULES.values():
        text = f"**{rule.title}.** {rule.rationale}".replace("|", "\\|")
        rows.append(f"| `{rule.id}` | {rule.severity} | {text} |")
    return "\n".join(rows) + "\n"
