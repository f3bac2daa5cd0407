"""Rules about the shape of the machine and the optimizer's numbers: TOPO001 (a TPU slice's device
count or mesh shape written as numbers) and BF16OPT001 (optimizer moments or gradient accumulators
kept in a 16-bit type)."""

from __future__ import annotations

import ast
import functools

from migration.codecheck.ast_helpers import (const_str, dotted, last_name, name_tokens, target_names, walk)
from migration.codecheck.family import RuleFamily

MESH_BUILDERS = {"create_device_mesh", "create_hybrid_device_mesh", "make_mesh"}
DEVICE_LISTS = {"devices", "local_devices"}
DEVICE_COUNTS = {"device_count", "local_device_count"}
CORE_TOKENS = {"core", "cores", "tpu", "tpus", "chip", "chips"}
HALF = {"bfloat16", "float16", "half"}
OPT_STATE_KEYWORDS = {"mu_dtype", "nu_dtype", "accumulator_dtype", "dtype_momentum", "momentum_dtype"}
ACCUMULATOR_TOKENS = {"acc", "accum", "accumulated", "accumulator", "accumulators"}


def int_literals(node: ast.AST) -> list[int] | None:
    """[4, 2] for `(4, 2)` or `[4, 2]`; None when any entry is not an int literal (or -1)."""
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List)) else [node]
    values = [e.value for e in elts if isinstance(e, ast.Constant) and type(e.value) is int]
    return values if len(values) == len(elts) and all(v > 0 for v in values) else None


@functools.lru_cache(maxsize=4096)
def is_accumulator(name: str) -> bool:
    """`grad_acc`, `self.accumulated_grads`: a name for accumulated values."""
    return bool(set(name_tokens(name.rsplit(".", 1)[-1])) & ACCUMULATOR_TOKENS)


def is_half(node: ast.AST | None) -> bool:
    return node is not None and ((const_str(node) or dotted(node)).rsplit(".", 1)[-1] in HALF)


class TopologyRules(RuleFamily):
    """TOPO001 and BF16OPT001, node by node."""

    def call(self, node: ast.Call, last: str) -> None:
        self._mesh_shape(node, last)
        for k in node.keywords:
            if k.arg in OPT_STATE_KEYWORDS and is_half(k.value):
                self.add(node, "BF16OPT001", f"`{k.arg}={dotted(k.value) or const_str(k.value)}` keeps optimizer "
                                             "state in 16 bits")

    def _mesh_shape(self, node: ast.Call, last: str) -> None:
        shape = int_literals(node.args[0]) if node.args else None
        if last in MESH_BUILDERS and shape and len(shape) > 1 and _product(shape) > 1:  # (1, 1): one device, tests
            self.add(node, "TOPO001", f"`{last}({tuple(shape)})` fixes the mesh to {_product(shape)} devices")
        elif last == "reshape" and isinstance(node.func, ast.Attribute) and self._device_list(node.func.value):
            shape = int_literals(node.args[0]) if len(node.args) == 1 else int_literals(ast.Tuple(node.args))
            if shape and _product(shape) > 1:
                self.add(node, "TOPO001", f"the device list is reshaped to {tuple(shape)}: "
                                          f"{_product(shape)} devices, a TPU slice's layout")

    def _device_list(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.Call) and last_name(n.func) in DEVICE_LISTS for n in walk(node))

    def compare(self, node: ast.Compare) -> None:
        """`assert jax.device_count() == 8`, `assert cores_per_replica <= 8`, `if num_tpus == 32`."""
        operands = [node.left, *node.comparators]
        counts = [v for o in operands if (v := int_literals(o)) and len(v) == 1 and v[0] >= 2]
        if not counts:
            return
        for o in operands:
            if self._counts_devices(o):
                self.add(node, "TOPO001", f"the code expects {counts[0][0]} devices (or cores) by number")
                return

    def _counts_devices(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and (last_name(node.func) in DEVICE_COUNTS or last_name(node.func) == "len"
                                           and node.args and self._device_list(node.args[0])):
            return True
        name = dotted(node)
        return bool(name) and bool(set(name_tokens(name.rsplit(".", 1)[-1])) & CORE_TOKENS)

    def assign(self, node: ast.Assign | ast.AnnAssign) -> None:
        """`grad_acc = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.bfloat16), params)`."""
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [n for t in targets for n in target_names(t)]
        if node.value is None or not any(is_accumulator(n) for n in names):
            return
        half = [n for n in walk(node.value) if isinstance(n, ast.keyword) and n.arg == "dtype" and is_half(n.value)]
        half += [n for n in walk(node.value) if isinstance(n, ast.Call) and last_name(n.func) == "astype"
                 and n.args and is_half(n.args[0])]
        if half:
            self.add(node, "BF16OPT001", f"`{names[0]}` accumulates gradients in 16 bits")


def _product(shape: list[int]) -> int:
    total = 1
    for v in shape:
        total *= v
    return total
