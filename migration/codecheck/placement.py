"""PMAP003's helpers that are not the libraries' own: a project's copy of `replicate`, `unreplicate`,
`shard` or jaxline's `get_first`, recognised by its name and by what its body does, and the
distinctive names of such helpers when they come from a project module the check cannot read.

A function of the file is a placement helper when its name or a parameter says so (`_unpmap`, `shard_batch`,
`_for_n_devices`, `get_first`; `def _convert(self, value, devices)`) and its body has one of the helpers'
shapes:

- it takes each leaf's first copy (`lambda x: x[0]`, or a local function returning `x[0]`),
  the shape of `unreplicate`;
- it reshapes leaves to a leading device axis (a `.reshape(...)` whose shape mentions a device
  count), the shape of `shard`;
- it copies leaves to every device (`device_put_replicated`, `broadcast_to` with a device count) or
  calls a library placement helper, the shape of `replicate`.

Its calls are reported, not its body: that is where the data is placed."""

from __future__ import annotations

import ast

from migration.codecheck.ast_helpers import last_name, name_tokens, walk

# words in a helper's name (one of them is needed, as well as the shape)
HELPER_NAME_TOKENS = {"replicate", "replicated", "unreplicate", "shard", "unpmap", "first", "bcast", "broadcast",
                      "devices", "device"}
# names distinctive enough to be a pmap-era helper wherever it is imported from (a project's `helpers.get_first`)
DISTINCTIVE_NAMES = {"get_first", "bcast_local_devices", "unreplicate", "get_from_first_device",
                     "replicate_all_local_devices", "broadcast_all_local_devices", "for_n_devices",
                     "shard_prng_key", "pad_shard_unpad", "replicate_model_state", "de_replicate", "dereplicate"}
DEVICE_PARAMS = {"devices", "local_devices", "n_devices", "num_devices"}  # a parameter that says it places
DEVICE_COUNT_CALLS = {"local_device_count", "device_count"}
DEVICE_COUNT_TOKENS = {"devices", "device", "replicas", "ndev", "ndevices"}
COPY_CALLS = {"device_put_replicated", "device_put_sharded", "for_n_devices"}


def placement_helpers(functions: list[ast.FunctionDef | ast.AsyncFunctionDef], library_call) -> set[int]:
    """ids of the functions that are placement helpers by name and shape; `library_call(call)` says
    whether a call is one of the libraries' placement helpers."""
    found = set()
    for fn in functions:
        tokens = set(name_tokens(fn.name))
        params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
        says = tokens & HELPER_NAME_TOKENS or params & DEVICE_PARAMS  # `def _convert_inps(self, value, devices)`
        if says and (_first_copy(fn) or _device_reshape(fn) or _copies(fn, library_call)):
            found.add(id(fn))
    return found


def _first_copy(fn: ast.AST) -> bool:
    """A lambda or nested function in `fn` returning its parameter's first element (`lambda x: x[0]`)."""
    for node in walk(fn):
        if isinstance(node, ast.Lambda):
            body, args = node.body, node.args.args
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not fn and len(node.body) == 1 \
                and isinstance(node.body[0], ast.Return):
            body, args = node.body[0].value, node.args.args
        else:
            continue
        if len(args) == 1 and isinstance(body, ast.Subscript) and isinstance(body.value, ast.Name) \
                and body.value.id == args[0].arg and isinstance(body.slice, ast.Constant) and body.slice.value == 0:
            return True
    return False


def _mentions_device_count(node: ast.AST, counts: set[str]) -> bool:
    for sub in walk(node):
        if isinstance(sub, ast.Call) and last_name(sub.func) in DEVICE_COUNT_CALLS:
            return True
        if isinstance(sub, (ast.Name, ast.Attribute)) and (last_name(sub) in counts or
                                                           set(name_tokens(last_name(sub))) & DEVICE_COUNT_TOKENS):
            return True
    return False


def _device_counts(fn: ast.AST) -> set[str]:
    """Names `fn` binds to a device count (`n = jax.local_device_count()`)."""
    return {t.id for node in walk(fn) if isinstance(node, ast.Assign) and _mentions_device_count(node.value, set())
            for t in node.targets if isinstance(t, ast.Name)}


def _device_reshape(fn: ast.AST) -> bool:
    counts = _device_counts(fn)
    return any(isinstance(n, ast.Call) and last_name(n.func) == "reshape" and n.args
               and _mentions_device_count(n.args[0], counts) for n in walk(fn))


def _copies(fn: ast.AST, library_call) -> bool:
    counts = _device_counts(fn)
    return any(isinstance(n, ast.Call) and (last_name(n.func) in COPY_CALLS or library_call(n) or last_name(n.func)
                                            == "broadcast_to" and any(_mentions_device_count(a, counts) for a in n.args))
               for n in walk(fn))
