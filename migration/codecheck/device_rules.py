"""Device and API rules: TPU001 (TPU-only device selection), PMAP001 (pmap), PMAP002 (collectives
under pmap), REMOVED001 (APIs removed from JAX) and REMOVED002 (clear_backends)."""

from __future__ import annotations

import ast

from migration.codecheck.ast_helpers import (assigned_pairs, const_str, dotted, last_name, name_tokens, target_names,
                                             walk)
from migration.codecheck.context import Context
from migration.codecheck.family import RawFinding, RuleFamily
from migration.codecheck.placement import DISTINCTIVE_NAMES
from migration.codecheck.transforms import Transform
from migration.codecheck.vocabulary import (COLLECTIVE_WRAPPERS, COLLECTIVES, CONFIG_TOKENS, DEVICE_QUERIES, PJIT_KEYWORDS, PLACEMENT_HELPERS,
                                            PLACEMENT_REPLACEMENT,
                                            PLATFORM_ATTRS, PLATFORM_KEYS, REMOVED, REMOVED_ARRAY_ATTRS, TPU_DEVICE_ATTRS,
                                            TPU_DRIVER_KEYS,
                                            removed_from, removed_key)


class DeviceRules(RuleFamily):
    """TPU001, PMAP001/002, REMOVED001/002: what selects the TPU, replicates by hand, or no longer exists."""

    def __init__(self, ctx: Context, found: list[RawFinding]):
        super().__init__(ctx, found)
        self.pmap_depth = 0
        self.platform_names: set[str] = set()
        queries = ctx.words & {a.lower() for a in PLATFORM_ATTRS} | ctx.words & {"default_backend", "get_backend"}
        writes = ctx.of(ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr) if queries else []
        self.platform_names = {n for node in writes for t, v in assigned_pairs(node) if self.platform_query(v)
                               for n in target_names(t)}

    # imports and names (REMOVED001, PMAP001) ----------------------------------------------
    def removed_import(self, node: ast.AST, names: list[str]) -> None:
        for full in names:
            key = removed_key(full)
            if key:
                self.add(node, "REMOVED001", f"`{full}` is imported: it was removed from {removed_from(key)}",
                         REMOVED[key])
                return

    def name_use(self, node: ast.Name | ast.Attribute) -> None:
        full = self.ctx.resolve(node)
        root = dotted(node).split(".")[0]
        if full == "jax.pmap" or self.ctx.is_bare(node) and node.id == "pmap":
            self.add(node, "PMAP001", "pmap is in maintenance mode; it replicates by hand what jit + sharding does")
        key = removed_key(full)
        if key and root not in self.ctx.removed_bindings:
            self.add(node, "REMOVED001", f"`{full}` was removed from {removed_from(key)}", REMOVED[key])
        if isinstance(node, ast.Attribute) and node.attr in REMOVED_ARRAY_ATTRS and self.ctx.uses_jax:
            self.add(node, "REMOVED001", f"`.{node.attr}` was removed from JAX arrays (jax 0.4.27): it raises "
                                         "AttributeError", REMOVED_ARRAY_ATTRS[node.attr])
        if isinstance(node, ast.Attribute) and node.attr in TPU_DEVICE_ATTRS and self.ctx.uses_jax \
                and ({"device", "devices", "dev", "d"} & set(name_tokens(dotted(node.value)))
                     or any(isinstance(n, ast.Call) and last_name(n.func) in ("devices", "local_devices")
                            for n in walk(node.value))):
            self.add(node, "TPU001", f"`.{node.attr}` is an attribute only TPU devices have (their place in the "
                                     "slice): a GPU device raises AttributeError")

    # functions (PMAP002 context) -----------------------------------------------------------
    def enter_function(self, transforms: list[Transform]) -> bool:
        """Count a pmapped function's body as under pmap; True when it is pmapped."""
        pmapped = any(t.pmap for t in transforms)
        self.pmap_depth += pmapped
        return pmapped

    def leave_function(self, pmapped: bool) -> None:
        self.pmap_depth -= pmapped

    # calls ---------------------------------------------------------------------------------
    def call(self, node: ast.Call, name: str, last: str) -> None:
        self._tpu_call(node, name, last)
        self._pjit_keywords(node, name, last)
        self._placement(node, name, last)
        self._collective(node, name, last)
        if last in ("device_put_replicated", "device_put_sharded") and self.ctx.is_bare(node.func):
            self.add(node, "REMOVED001", f"`{name or last}` was removed in JAX 0.10", REMOVED[f"jax.{last}"])
        if last == "clear_backends":
            self.add(node, "REMOVED002", f"`{name or last}` no longer exists")

    def _placement(self, node: ast.Call, name: str, last: str) -> None:
        """PMAP003: a library's placement helper, called or handed to a call that maps it over a tree
        (`tree_map(replicate, x)`), this file's copy of one, or one by a distinctive name from a project
        module."""
        message = "places data by hand for pmap (a leading device axis, a copy per device)"
        handed = [a for a in node.args if isinstance(a, (ast.Name, ast.Attribute))
                  and self.ctx.resolve(a) in PLACEMENT_HELPERS]
        if name in PLACEMENT_HELPERS:
            self.add(node, "PMAP003", f"`{last}` {message}", PLACEMENT_HELPERS[name])
            return
        if handed:
            self.add(handed[0], "PMAP003", f"`{last_name(handed[0])}` {message}",
                     PLACEMENT_HELPERS[self.ctx.resolve(handed[0])])
            return
        fn = self.ctx.callee(node)
        if fn is not None and id(fn) in self.ctx.placement_helpers:
            self.add(node, "PMAP003", f"`{last}` (a copy of a pmap-era helper, line {fn.lineno}) {message}",
                     PLACEMENT_REPLACEMENT)
        elif fn is None and (last in DISTINCTIVE_NAMES or self._project_shard(node, last)) \
                and name.split(".")[0] not in ("jax", "flax", "numpy"):
            self.add(node, "PMAP003", f"`{name or last}` (by its name, a pmap-era helper) {message}",
                     PLACEMENT_REPLACEMENT)

    def _project_shard(self, node: ast.Call, last: str) -> bool:
        """`data_utils.shard(batch)`: a project module's own copy of Flax's `common_utils.shard`, called on
        one batch (a dataset's `ds.shard(count, index)` is a method of an object, with two arguments)."""
        func = node.func
        return last == "shard" and len(node.args) == 1 and not node.keywords and isinstance(func, ast.Attribute) \
            and isinstance(func.value, ast.Name) and func.value.id in self.ctx.aliases \
            and self.ctx.aliases[func.value.id].split(".")[0] not in ("tensorflow", "torch", "tf", "datasets")

    def _tpu_call(self, node: ast.Call, name: str, last: str) -> None:
        if name.startswith("jax.tools.colab_tpu"):
            self.add(node, "TPU001", f"`{last}()` connects a Colab runtime to its TPU: there is none on a GPU machine")
        backend = next((const_str(k.value) for k in node.keywords if k.arg == "backend"), None) \
            if node.keywords else None
        arg = const_str(node.args[0]) if node.args and last in DEVICE_QUERIES else None
        if backend and backend.lower() == "tpu" or arg and arg.lower() == "tpu":
            self.add(node, "TPU001", f"`{name or last}(... \"tpu\")` selects TPU devices only: it fails on a GPU "
                                     "machine")
        if last in ("startswith", "endswith") and isinstance(node.func, ast.Attribute) and node.args \
                and names_only_tpu(node.args[0]) and self.platform_query(node.func.value):
            self.add(node, "TPU001", "the code checks for a TPU device: on a GPU machine the check fails or the "
                                     "TPU branch never runs")
        option = const_str(node.args[0]) if name.endswith("config.update") and len(node.args) > 1 else None
        value = (const_str(node.args[1]) or "") if option else ""
        if option in PLATFORM_KEYS and "tpu" in value.lower().split(","):
            self.add(node, "TPU001", f"`{option}` is set to {value!r}: JAX then looks for a TPU")
        if option in TPU_DRIVER_KEYS and (value == "tpu_driver" or value.startswith("grpc://")):
            self.add(node, "TPU001", f"`{option}` is set to {value!r}: the TPU era's remote TPU driver, which GPUs "
                                     "do not have")
        key = removed_key(f"jax.config.{option}") if option else None
        if key:
            self.add(node, "REMOVED001", f"the config option `{option}` was removed from JAX: the update raises",
                     REMOVED[key])

    def _pjit_keywords(self, node: ast.Call, name: str, last: str) -> None:
        """PJIT001: pjit (or jit, or a functools.partial of either) given the removed keywords."""
        target = name
        if name in ("functools.partial", "partial") and node.args:
            target = self.ctx.resolve(node.args[0])
        old = [kw.arg for kw in node.keywords if kw.arg in PJIT_KEYWORDS]
        if not old:
            return
        if not (target.startswith("jax.") and target.rsplit(".", 1)[-1] in ("pjit", "jit")
                or self.ctx.is_bare(node.func) and last == "pjit" or self._bound_to_pjit(node.func)):
            return
        if old:  # one finding per call, at the call: one change fixes it
            self.add(node, "PJIT001", " and ".join(f"`{k}=`" for k in old) + " removed from pjit: the call raises a "
                     "TypeError", " and ".join(f"{PJIT_KEYWORDS[k]}=" for k in old) + " (and jax.jit in place of pjit)")

    def _bound_to_pjit(self, func: ast.AST) -> bool:
        """`maybe_pjit = pjit if on_tpu else emulated_pjit`: a name this file binds to an expression naming
        JAX's pjit (another library's wrapper taking keywords of the same names is not pjit)."""
        if not isinstance(func, ast.Name):
            return False
        return any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == func.id for t in n.targets)
                   and any(isinstance(v, (ast.Name, ast.Attribute)) and self.ctx.resolve(v).startswith("jax.")
                           and self.ctx.resolve(v).endswith(".pjit") for v in walk(n.value))
                   for n in self.ctx.of(ast.Assign))

    def _collective(self, node: ast.Call, name: str, last: str) -> None:
        if (name.startswith("jax.lax.") and name.rsplit(".", 1)[-1] in COLLECTIVES or name in COLLECTIVE_WRAPPERS) and \
                (self.pmap_depth or self.ctx.uses_pmap and not self.ctx.uses_shard_map):
            self.add(node, "PMAP002", f"`{name}` inside a pmapped function")

    # comparisons (TPU001) ----------------------------------------------------------------------
    def compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        tpu = [o for o in operands if names_only_tpu(o)]
        if tpu and any(self.platform_query(o) for o in operands if o not in tpu):
            self.add(node, "TPU001", "the code checks for a TPU backend: on a GPU machine the check fails or the "
                                     "TPU branch never runs")

    def platform_query(self, node: ast.AST) -> bool:
        """An expression that reads the platform: default_backend(), device.platform / .device_kind,
        or a name assigned one of those."""
        for sub in walk(node):
            if isinstance(sub, ast.Name) and sub.id in self.platform_names:
                return True
            if isinstance(sub, ast.Call) and last_name(sub.func) in ("default_backend", "get_backend"):
                return True
            if isinstance(sub, ast.Attribute) and sub.attr in PLATFORM_ATTRS:
                return not (set(name_tokens(dotted(sub.value))) & CONFIG_TOKENS)
        return False


def names_only_tpu(node: ast.AST) -> bool:
    """A string naming the TPU ("tpu", "TPU v4"), or a tuple of strings that only name TPUs."""
    if const_str(node) is not None:
        return "tpu" in node.value.lower()
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts:
        values = [(const_str(e) or "").lower() for e in node.elts]
        return any("tpu" in v for v in values) and not any(p in v for v in values for p in ("gpu", "cuda", "rocm"))
    return False
