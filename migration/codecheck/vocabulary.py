"""The words the checks recognise: JAX transformations, clocks, host and device calls, logging and
configuration names, and the APIs removed from JAX with their replacements."""

from __future__ import annotations

import ast
import functools

from migration.codecheck.removed_api import CHANGELOG_REMOVED

ENV_PREFIXES = ("XLA_", "JAX_", "CUDA_VISIBLE_DEVICES", "TF_CPP_", "NCCL_")
JAX_IMPORTERS = {"jax", "jaxlib", "flax", "optax", "orbax", "chex", "haiku", "equinox", "jmp"}
DEFAULT_ALIASES = {"jnp": "jax.numpy", "np": "numpy", "lax": "jax.lax"}
CLOCKS = {"time.time", "time.time_ns", "time.perf_counter", "time.perf_counter_ns", "time.monotonic",
          "time.monotonic_ns", "timeit.default_timer", "datetime.datetime.now", "datetime.datetime.utcnow"}
COMPILE_TRANSFORMS = {"jit", "pjit", "pmap", "xmap", "shard_map", "vmap", "checkpoint", "remat", "custom_jvp",
                      "custom_vjp"}
GRAD_TRANSFORMS = {"grad", "value_and_grad", "jacfwd", "jacrev", "hessian"}
CONTROL_FLOW = {"scan", "fori_loop", "while_loop", "cond", "switch", "map", "associative_scan"}
BARE_TRANSFORMS = {"jit", "pjit", "pmap", "xmap", "vmap", "grad", "value_and_grad", "shard_map"}
COLLECTIVES = {"pmean", "psum", "pmax", "pmin", "all_gather", "ppermute", "all_to_all", "psum_scatter",
               "axis_index"}
# libraries' own wrappers of a collective, used under pmap like it (kfac_jax reduces only when pmapped)
COLLECTIVE_WRAPPERS = {"kfac_jax.utils.pmean_if_pmap", "kfac_jax.utils.psum_if_pmap", "kfac_jax.utils.pmax_if_pmap"}
STEP_TOKENS = {"step", "train", "update"}
# base classes whose `step` method a framework runs once every training step
FRAMEWORK_EXPERIMENTS = {"jaxline.experiment.AbstractExperiment"}
# an RL environment's `env.step(action)` runs the simulator on the host, not a training step
ENV_TOKENS = {"env", "envs", "environment", "environments"}
# evolution strategies (evosax, evojax) update through `strategy.ask(...)` / `solver.tell(...)`
ES_METHODS = {"ask", "tell"}
ES_RECEIVERS = {"strategy", "solver", "es", "algorithm", "optimizer"}
# optax builds transformations and schedules (host objects); these of its calls compute arrays
OPTAX_ARRAYS = {"optax.apply_updates", "optax.global_norm", "optax.incremental_update", "optax.periodic_update",
                "optax.safe_norm", "optax.safe_root_mean_squares", "optax.l2_loss", "optax.huber_loss",
                "optax.softmax_cross_entropy", "optax.softmax_cross_entropy_with_integer_labels",
                "optax.sigmoid_binary_cross_entropy", "optax.cosine_similarity", "optax.cosine_distance",
                "optax.kl_divergence", "optax.log_cosh", "optax.smooth_labels", "optax.squared_error"}
OPTAX_ARRAY_NAMESPACES = ("optax.losses.", "optax.tree_utils.", "optax.tree.", "optax.projections.")
# a loop whose steps only evaluate, predict or generate is not the training loop SYNC001 is about
# functions that map a function over a pytree's leaves (any era's spelling)
TREE_MAPS = {"jax.tree.map", "jax.tree_map", "jax.tree_util.tree_map", "jax.tree_multimap",
             "jax.tree_util.tree_multimap", "tree.map_structure"}
# words of an argument that make a call handed the step counter a schedule (`itstime(step, log_every_steps)`)
INTERVAL_WORDS = {"every", "steps", "interval", "intervals", "freq", "frequency", "period", "periodic"}
EVAL_TOKENS = {"eval", "evaluate", "evaluation", "predict", "prediction", "pred", "generate", "generation", "test",
               "valid", "validation", "val", "sample", "infer", "inference", "decode"}
# attributes that hold a training state on an object handed to a step (`trainer.state`, `model.params`)
STATE_ATTRS = {"state", "params", "opt_state", "train_state", "variables"}
COMPUTE_NAMESPACES = ("jax.numpy.", "jax.lax.", "jax.random.", "jax.nn.", "jax.scipy.", "jax.image.",
                      "jax.device_put")
HOST_BUILTINS = {"float", "int", "bool", "str", "repr", "complex", "format", "round", "len", "range", "enumerate",
                 "zip", "print", "isinstance", "issubclass", "hasattr", "type", "id", "hash", "open", "sorted"}
HOST_NAMESPACES = ("numpy.", "math.", "time.", "os.", "json.", "logging.", "random.", "statistics.")
HOST_JAX = {"jax.device_get", "jax.devices", "jax.local_devices", "jax.device_count", "jax.local_device_count",
            "jax.process_index", "jax.process_count", "jax.default_backend"}
CONVERSIONS = {"float", "int", "bool", "str", "repr", "complex", "format", "round"}
SYNC_METHODS = {"item", "tolist"}
WAIT_METHODS = {"block_until_ready", "wait_until_finished", "result"}  # `future.result()` blocks too
# Calls that return only once their work is done, so a clock read after them measures it: waits
# (`jax.block_until_ready`, `jax.device_get`, barriers across processes) and compiling ahead of time
# (`f.lower(x).compile()` traces and compiles on the host before it returns).
SYNCHRONOUS_CALLS = {"jax.device_get", "jax.block_until_ready", "jax.effects_barrier",
                     "jax.experimental.multihost_utils.sync_global_devices",
                     "jax.experimental.multihost_utils.process_allgather",
                     "flax.training.common_utils.get_metrics"}  # stacks a list of metrics and device_gets it
SYNCHRONOUS_METHODS = {"compile"}
# saving a checkpoint copies the device values it is given to the host before it returns
SAVE_METHODS = {"save", "save_checkpoint", "save_state", "save_params"}
# calls that read files or checkpoints: host I/O, not work dispatched to the device (`read_ckpt(...)`)
HOST_IO_TOKENS = {"load", "read", "restore"}
AOT_METHODS = {"lower", "compile", "trace", "eval_shape", "cost_analysis", "memory_analysis", "as_text"}
LOG_METHODS = {"info", "debug", "warning", "warn", "error", "critical", "log", "scalar", "scalars", "add_scalar",
               "add_scalars", "write_scalars", "log_metrics", "set_postfix", "set_description"}
NOT_LOGGERS = {"jax", "numpy", "math", "torch", "tensorflow", "scipy", "optax", "flax"}
STATIC_ATTRS = {"shape", "ndim", "dtype", "size", "sharding", "weak_type"}
STATIC_FUNCS = {"isinstance", "len", "hasattr", "callable", "type", "getattr", "ndim", "shape", "size", "iscomplexobj",
                "isrealobj", "issubdtype", "result_type"}
DEVICE_QUERIES = {"devices", "local_devices", "device_count", "local_device_count", "get_backend"}
PLATFORM_KEYS = {"jax_platform_name", "jax_platforms"}
# the TPU era's remote-TPU switches: the tpu_driver backend and the address of a TPU it connects to
TPU_DRIVER_KEYS = {"jax_xla_backend", "jax_backend_target"}
TPU_DEVICE_ATTRS = {"coords", "core_on_chip"}  # attributes only a TPU device has
# attributes of the old DeviceArray that jax.Array no longer has
REMOVED_ARRAY_ATTRS = {"device_buffer": "x.addressable_data(0) (or x.addressable_shards[0].data)",
                       "device_buffers": "[s.data for s in x.addressable_shards]"}  # jax 0.4.27 changelog
PLATFORM_ENV = {"JAX_PLATFORMS", "JAX_PLATFORM_NAME"}
PLATFORM_ATTRS = {"platform", "device_kind"}
CONFIG_TOKENS = {"args", "arg", "config", "cfg", "conf", "flags", "opts", "options", "hparams", "hps", "settings"}
LOW_PRECISION = {"bfloat16", "fastest", "default"}
BATCH_MIN = 512
SIZE_TOKENS = {"batch", "batchsize", "bs", "bsz"}
NOT_SIZE_TOKENS = {"num", "n", "nb", "count", "cnt", "idx", "index", "id", "ids", "i", "step", "steps", "every",
                   "freq", "interval", "no", "max", "min", "limit", "cap", "threshold"}
NOT_STEP_PREFIXES = {"is", "has", "should", "can", "make", "build", "create", "get"}
STEP_FN_SUFFIXES = {"fn", "func", "function", "impl"}
# a call that runs many steps, a whole epoch or the whole training: `train_epoch`, `train_and_evaluate`
MANY_STEPS_TOKENS = {"epoch", "epochs", "loop", "and"}
HALF_DTYPES = {"jax.numpy.float16", "numpy.float16", "jax.numpy.half", "numpy.half", "tensorflow.float16",
               "tensorflow.half"}
# libraries' own names for JAX's (trax's backend-neutral `fastmath`): read as the JAX name they stand for
WRAPPERS = {"trax.fastmath.pmap": "jax.pmap", "trax.fastmath.psum": "jax.lax.psum",
            "trax.fastmath.pmean": "jax.lax.pmean", "ninjax.pmap": "jax.pmap",
            "jaxline.utils.tree_psum": "jax.lax.psum"}  # jaxline's alias until 2023
# libraries projects copy into their own package (`from . import ninjax as nj`), read as the library
VENDORED = {"ninjax"}
DTYPE_NAMES = {"float16", "float32", "float64", "bfloat16", "half", "single", "double", "int8", "int16", "int32",
               "int64", "uint8", "uint16", "uint32", "uint64", "bool_", "complex64", "complex128"}
LOSS_SCALING_HINTS = ("loss_scal", "lossscal", "dynamic_scale", "dynamicscale", "gradscaler", "grad_scaler")
LOOPS = (ast.For, ast.AsyncFor, ast.While)
MUTATORS = {"append", "extend", "insert", "add", "appendleft"}
APPLY_METHODS = {"apply", "apply_fn", "apply_gradients", "apply_updates", "value_and_grad"}
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
# Removed APIs: the changelogs' names (removed_api.py, generated), then the hand-kept ones below, whose
# replacements are written out (they win where both name one).
REMOVED = CHANGELOG_REMOVED | {
    "jax.device_put_replicated": "jax.device_put(x, NamedSharding(mesh, P())) to replicate",
    "jax.device_put_sharded": "jax.device_put(x, NamedSharding(mesh, P('data'))) to shard along the mesh",
    "jax.tree_map": "jax.tree.map", "jax.tree_multimap": "jax.tree.map", "jax.tree_leaves": "jax.tree.leaves",
    "jax.tree_flatten": "jax.tree.flatten", "jax.tree_unflatten": "jax.tree.unflatten",
    "jax.tree_structure": "jax.tree.structure", "jax.tree_transpose": "jax.tree.transpose",
    "jax.tree_reduce": "jax.tree.reduce", "jax.tree_util.tree_multimap": "jax.tree.map",
    "jax.xla_computation": "jax.jit(f).lower(*args).compiler_ir()",
    "jax.experimental.maps": "jax.shard_map for xmap; jax.make_mesh (or jax.sharding.Mesh) for Mesh",
    "jax.experimental.PartitionSpec": "jax.sharding.PartitionSpec",
    "jax.experimental.optimizers": "optax", "jax.experimental.stax": "flax.linen (or jax.example_libraries.stax)",
    "jax.experimental.host_callback": "jax.debug.callback or jax.experimental.io_callback",
    "jax.experimental.global_device_array": "jax.Array built with jax.make_array_from_callback",
    "jax.ops.index_update": "x.at[idx].set(y)", "jax.ops.index_add": "x.at[idx].add(y)", "jax.ops.index": "x.at[idx]",
    "jax.random.KeyArray": "jax.Array (keys from jax.random.key)", "jax.numpy.DeviceArray": "jax.Array",
    "jax.interpreters.xla.DeviceArray": "jax.Array", "jax.lib.xla_bridge": "jax.default_backend() / jax.devices()",
    "jax.sharding.PositionalSharding": "NamedSharding(mesh, P(...))", "flax.optim": "optax",
    "jax.experimental.pjit.with_sharding_constraint": "jax.lax.with_sharding_constraint",
    "jax.experimental.pjit.PartitionSpec": "jax.sharding.PartitionSpec",
    "jax.interpreters.pxla.ShardedDeviceArray": "jax.Array", "jax.random.PRNGKeyArray": "jax.Array",
    "jax.abstract_arrays": "jax.core.ShapedArray", "jax.lax.tie_in": "nothing: drop the call (a no-op since 2020)",
    "jax.experimental.gda_serialization": "orbax.checkpoint", "jax.experimental.enable_x64":
        "jax.config.update('jax_enable_x64', True)",
    "jax.ShapedArray": "jax.core.ShapedArray (or jax.ShapeDtypeStruct for a shape and dtype)",
    "jax.spmd_mode": "nothing: drop the `with jax.spmd_mode(...)` block's wrapper (jit over sharded arrays needs no mode)",
    "jax.experimental.compilation_cache.compilation_cache.initialize_cache":
        "jax.config.update('jax_compilation_cache_dir', path)",
    "flax.nn": "flax.linen (or flax.nnx)",
    # from JAX's changelog (bench/removed_api_candidates.py lists the candidates; each checked absent)
    "jax.experimental.compilation_cache.initialize_cache": "jax.config.update('jax_compilation_cache_dir', path)",
    "jax.interpreters.pxla.Mesh": "jax.sharding.Mesh", "jax.interpreters.pxla.PartitionSpec": "jax.sharding.PartitionSpec",
    "jax.experimental.pjit.NamedSharding": "jax.sharding.NamedSharding",
    "jax.sharding.PmapSharding": "NamedSharding(mesh, P(...)) under jit",
    "jax.sharding.XLACompatibleSharding": "jax.sharding.Sharding",
    "jax.lax.infeed": "arguments to the jitted function (TPU infeed has no GPU counterpart)",
    "jax.lax.outfeed": "results of the jitted function, or jax.debug.callback",
    "jax.random.shuffle": "jax.random.permutation(key, x, independent=True)",
    "jax.numpy.round_": "jax.numpy.round", "jax.numpy.product": "jax.numpy.prod", "jax.numpy.alltrue": "jax.numpy.all",
    "jax.numpy.sometrue": "jax.numpy.any", "jax.numpy.cumproduct": "jax.numpy.cumprod",
    "jax.numpy.row_stack": "jax.numpy.vstack", "jax.numpy.trapz": "jax.scipy.integrate.trapezoid",
    "jax.numpy.in1d": "jax.numpy.isin(x, values).ravel()", "jax.numpy.msort": "jax.numpy.sort(x, axis=0)",
    "jax.numpy.NINF": "-jax.numpy.inf", "jax.numpy.PINF": "jax.numpy.inf", "jax.numpy.NZERO": "-0.0",
    "jax.lib.xla_client": "jax.extend or the public jax APIs", "jax.lib.xla_extension": "jax.extend",
    "jax.linear_util": "jax.extend.linear_util", "jax.prng": "jax.extend.random", "jax.util": "your own helper",
    "jax.curry": "functools.partial", "jax.partial_eval": "jax.extend or jax.interpreters.partial_eval",
    "jax.pxla": "jax.sharding", "jax.xla": "jax.extend", "jax.experimental.export": "jax.export",
    "jax.treedef_is_leaf": "jax.tree_util.treedef_is_leaf",
    "jax.tools.colab_tpu": "nothing: delete the setup call (JAX finds the local GPUs itself)",
    # the TPU era's configuration switches, gone from jax.config
    "jax.config.jax_enable_omnistaging": "nothing: omnistaging is how JAX always traces now",
    "jax.config.enable_omnistaging": "nothing: omnistaging is how JAX always traces now",
    "jax.config.disable_omnistaging": "nothing: omnistaging can no longer be turned off",
    "jax.config.FLAGS": "jax.config.update(name, value) (or absl flags parsed with jax.config.parse_flags_with_absl())",
    "jax.profiler.StepTraceContext": "jax.profiler.StepTraceAnnotation",
    "jax.profiler.TraceContext": "jax.profiler.TraceAnnotation",
}
# The pmap era's placement helpers: they copy state to every local device, split a batch into a
# leading device axis, or gather it back, by hand, for pmap. Under jit with shardings each becomes a
# device_put with a NamedSharding (or nothing at all).
PLACEMENT_HELPERS = {
    "flax.jax_utils.replicate": "jax.device_put(x, NamedSharding(mesh, P())) (or keep the state sharded)",
    "flax.jax_utils.unreplicate": "nothing: a replicated or sharded jax.Array is already one array",
    "flax.jax_utils.prefetch_to_device": "jax.device_put(batch, NamedSharding(mesh, P('data'))) ahead of the step",
    "flax.jax_utils.pad_shard_unpad": "jit with a batch sharded over the mesh (pad the last batch yourself if needed)",
    "flax.training.common_utils.shard": "jax.device_put(batch, NamedSharding(mesh, P('data'))): no leading device axis",
    "flax.training.common_utils.shard_prng_key": "one key: jit splits the work, not the key",
    "jaxline.utils.bcast_local_devices": "jax.device_put(x, NamedSharding(mesh, P()))",
    "jaxline.utils.get_first": "nothing: a replicated or sharded jax.Array is already one array",
    "acme.jax.utils.get_from_first_device": "jax.device_get(x) of the sharded array (no first copy to take)",
    "acme.jax.utils.replicate_in_all_devices": "jax.device_put(x, NamedSharding(mesh, P()))",
    "kfac_jax.utils.replicate_all_local_devices": "jax.device_put(x, NamedSharding(mesh, P()))",
    "kfac_jax.utils.broadcast_all_local_devices": "jax.device_put(x, NamedSharding(mesh, P()))",
    "kfac_jax.utils.make_different_rng_key_on_all_devices": "one key: jit splits the work, not the key",
    "paxml.trainer_lib.replicate_model_state": "keep the state sharded with NamedSharding under jit",
    "praxis.py_utils.reshard": "jax.device_put(batch, NamedSharding(mesh, P('data'))): no leading device axis",
    "trax.layers.for_n_devices": "jax.device_put(x, NamedSharding(mesh, P()))",
}
PLACEMENT_REPLACEMENT = ("jax.device_put(x, NamedSharding(mesh, P())) to replicate, NamedSharding(mesh, P('data')) to "
                         "split a batch, or nothing: a sharded jax.Array is one array")
# pjit's keyword arguments that were renamed, then removed: passing them raises a TypeError.
PJIT_KEYWORDS = {"in_axis_resources": "in_shardings", "out_axis_resources": "out_shardings"}


def removed_from(key: str) -> str:
    """The library a REMOVED entry was removed from: Flax for flax.*, else JAX."""
    return "Flax" if key.startswith("flax.") else "JAX"


@functools.lru_cache(maxsize=8192)
def removed_key(full: str) -> str | None:
    """The REMOVED entry `full` falls under ('jax.experimental.maps' for 'jax.experimental.maps.xmap')."""
    parts = full.split(".")
    for n in range(len(parts), 1, -1):
        key = ".".join(parts[:n])
        if key in REMOVED:
            return key
    return None
