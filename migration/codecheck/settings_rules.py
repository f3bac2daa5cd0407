"""Rules on training settings written for the TPU: BATCH001 (a hard-coded TPU-sized batch), FP16001
(float16 without loss scaling) and PREC001 (matmul precision left to the platform default)."""

from __future__ import annotations

import ast

from migration.codecheck.ast_helpers import (const_int, const_str, dotted, is_batch_size_name, is_dtype, last_name,
                                             name_tokens)
from migration.codecheck.family import RuleFamily
from migration.codecheck.vocabulary import BATCH_MIN, HALF_DTYPES, LOW_PRECISION


class SettingsRules(RuleFamily):
    """BATCH001, FP16001 and PREC001."""

    # BATCH001 ------------------------------------------------------------------------------
    def check_batch(self, node: ast.AST, name: str | None, value: ast.AST | None) -> None:
        size = const_int(value)
        if name and size is not None and size >= BATCH_MIN and is_batch_size_name(name):
            self.add(node, "BATCH001", f"`{name} = {size}`: a TPU-pod-sized batch rarely fits one GPU's memory")

    def assign(self, node: ast.Assign) -> None:
        value = node.value
        if isinstance(value, ast.List) and value.elts and all(const_int(e) is not None for e in value.elts):
            value = max(value.elts, key=const_int)  # a sweep's sizes: `train_batch_sizes = [1024, 2048]`
        for target in node.targets:
            if isinstance(target, (ast.Name, ast.Attribute)):
                self.check_batch(node, last_name(target), value)

    def ann_assign(self, node: ast.AnnAssign) -> None:
        if isinstance(node.target, (ast.Name, ast.Attribute)):
            self.check_batch(node, last_name(node.target), node.value)

    def dict_entries(self, node: ast.Dict) -> None:
        for key, value in zip(node.keys, node.values):
            self.check_batch(value, const_str(key), value)

    def batch_call(self, node: ast.Call, name: str, last: str) -> None:
        for kw in node.keywords:
            if kw.arg != "default":
                self.check_batch(kw.value, kw.arg, kw.value)
        if name == "getattr" and len(node.args) > 2:  # getattr(cfg, "batch_size", 4096): the object comes first
            self.check_batch(node, const_str(node.args[1]), node.args[2])
            return
        first = const_str(node.args[0]) if node.args else None
        if not first:
            return
        if last == "add_argument":
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            self.check_batch(node, first.lstrip("-"), default)
        elif (last == "get" or last.startswith("DEFINE_")) and len(node.args) > 1:
            self.check_batch(node, first, node.args[1])
        elif last.startswith("DEFINE_"):  # flags.DEFINE_integer("batch_size", default=2048, ...)
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            self.check_batch(default or node, first, default)

    def batch_defaults(self, args: ast.arguments) -> None:
        positional = args.posonlyargs + args.args
        for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
            self.check_batch(default, arg.arg, default)
        for arg, default in zip(args.kwonlyargs, args.kw_defaults):
            if default is not None:
                self.check_batch(default, arg.arg, default)

    # PREC001 -------------------------------------------------------------------------------
    def precision(self, node: ast.Call, name: str) -> None:
        if name.endswith("config.update") and len(node.args) > 1 \
                and const_str(node.args[0]) == "jax_default_matmul_precision" and low_precision(node.args[1]):
            self.add(node, "PREC001", f"the default matmul precision is set to {const_str(node.args[1])!r}: "
                                      "TPU and GPU run it differently (bf16 passes vs TF32)")
        if name.endswith("default_matmul_precision") and isinstance(self.ctx.parents.get(node), ast.Expr):
            self.add(node, "PREC001", "`default_matmul_precision(...)` on its own does nothing: it is a context "
                                      "manager, so the platform default stays in effect")
        for kw in node.keywords:
            if kw.arg == "precision" and low_precision(kw.value):
                self.add(kw.value, "PREC001", "the platform-default matmul precision is requested: bf16 passes on "
                                              "TPU, TF32 on recent GPUs")

    # FP16001 -------------------------------------------------------------------------------
    def name_use(self, node: ast.Name | ast.Attribute) -> None:
        if self.ctx.resolve(node) in HALF_DTYPES:
            self._half(node)

    def constant(self, node: ast.Constant) -> None:
        if node.value == "float16" and self._string_dtype_site(node):
            self._half(node)

    def _string_dtype_site(self, node: ast.Constant) -> bool:
        parent = self.ctx.parents.get(node)
        if isinstance(parent, ast.keyword):
            return "dtype" in name_tokens(parent.arg or "")
        if isinstance(parent, ast.Call) and node in parent.args:
            return last_name(parent.func) in ("astype", "dtype")
        return self._dtype_target(node)

    def _dtype_target(self, node: ast.AST) -> bool:
        """`node` is the value given to something named like a dtype (`compute_dtype = ...`, `dtype=...`)."""
        parent = self.ctx.parents.get(node)
        if isinstance(parent, ast.keyword):
            return "dtype" in name_tokens(parent.arg or "")
        targets = getattr(parent, "targets", [getattr(parent, "target", None)])
        return isinstance(parent, (ast.Assign, ast.AnnAssign)) \
            and any("dtype" in name_tokens(last_name(t)) for t in targets)

    def _half(self, node: ast.AST) -> None:
        if self.ctx.has_loss_scaling or self._only_compared(node) or self._stored(node):
            return
        if self.ctx.jax_import is None and not self._dtype_target(node):
            return  # numpy-only code: float16 storage on the host is not a training dtype
        self.add(node, "FP16001", "float16 is used and the file has no loss scaling")

    def _stored(self, node: ast.AST) -> bool:
        """`{"outputs/pred": pred.astype("float16")}`: a result cast to half to be kept or written (a value of
        a dict being built), not a dtype the model computes in."""
        cast = self.ctx.parents.get(node)
        if not (isinstance(cast, ast.Call) and last_name(cast.func) == "astype"):
            return False
        holder = self.ctx.parents.get(cast)
        return isinstance(holder, ast.Dict) and any(v is cast for v in holder.values)

    def _only_compared(self, node: ast.AST) -> bool:
        """float16 in a comparison, an isinstance/issubdtype test, or a table of several dtypes."""
        parent = self.ctx.parents.get(node)
        if isinstance(parent, (ast.Tuple, ast.List, ast.Set)) and sum(map(is_dtype, parent.elts)) >= 2:
            return True
        if isinstance(parent, ast.Dict) and sum(map(is_dtype, parent.values)) >= 2:
            return True
        while parent is not None and not isinstance(parent, ast.stmt):
            if isinstance(parent, ast.Compare) or isinstance(parent, ast.Call) and \
                    last_name(parent.func) in ("isinstance", "issubdtype", "issubclass"):
                return True
            parent = self.ctx.parents.get(parent)
        return False


def low_precision(node: ast.AST) -> bool:
    """`"bfloat16"`, `"fastest"`, `"default"`, `lax.Precision.DEFAULT`, `Precision("bfloat16")`, or a tuple of them."""
    if isinstance(node, (ast.Tuple, ast.List)):
        return any(low_precision(e) for e in node.elts)
    if const_str(node) is not None:
        return node.value.lower() in LOW_PRECISION
    if isinstance(node, ast.Attribute):
        return node.attr == "DEFAULT" and dotted(node.value).endswith("Precision")
    if isinstance(node, ast.Call) and dotted(node.func).endswith("Precision") and node.args:
        return low_precision(node.args[0])
    return False
