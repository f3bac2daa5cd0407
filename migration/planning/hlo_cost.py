"""What a compiled step does, read from its optimized HLO text (`compiled.as_text()`): the kernels it
launches with their FLOPs and HBM bytes, and the collectives with the bytes each moves.

JAX 0.10's `cost_analysis()` answers None for a deviceless GPU compile, so the figures come from the
program text XLA prints after optimisation, read the way XLA's own GPU cost model reads it:

- a kernel is a top-level instruction of the entry computation (or of a loop body, counted as many
  times as the loop runs: XLA GPU's known trip count, or, in a TPU program, what its condition
  `counter < N` says with the step the body adds to the counter; a called computation is inlined; a
  conditional counts its costliest branch); a fusion is one kernel, and a collective fused into it (a TPU
  program's async collective fusion) a collective of its own beside it;
- FLOPs: 2 x output elements x contracted size for every dot (inside fusions too, and cuBLAS
  custom-calls with their dimension numbers); for convolutions 2 x batch x output and input
  features x the (output position, kernel tap) pairs that meet the input, exact under padding,
  strides and dilations (a TPU program writes batched products as such convolutions); for cuDNN's
  fused attention 4 x query elements x key length forward (half of it under a causal mask, which
  the kernel skips), 2.5 times that backward (five products for two); for TPU's splash attention
  (Pallas) the same per product, two forward, four in its dK/dV kernel and three in its dQ kernel;
- bytes: what a kernel reads and writes in HBM: its operands and results, except that an operand
  only sliced inside a fusion costs the slices, and a dynamic-update-slice or scatter of a buffer
  from outside writes only the update (a layer of a scanned stack, not the stack; a decode step's
  new keys and values, not the KV cache; an activation offloaded to the host, not the host buffer);
- collectives: the bytes of each all-gather, reduce-scatter, all-reduce, all-to-all and
  collective-permute, the size of its replica group, how many nodes that group spans (devices are
  numbered node by node, `per_node` to a node), and whether it runs asynchronously (the
  latency-hiding scheduler's start/done pairs, a collective fused beside a kernel, the permutes of XLA's
  windowed einsum loops, a computation run on another engine).

Pure text: no JAX here, so it is tested on any program text and runs where JAX is absent.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from typing import Any

from migration.planning.hlo_collectives import (
    ALL_REDUCE_GATHER,
    RAGGED_ALL_TO_ALL,
    ShardAssembly,
    first_group,
    group_size,
    received_buffers,
)

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8,
               "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3": 1, "f8e3m4": 1,
               "f8e8m0fnu": 1, "f4e2m1fn": 0.5}
ARRAY = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([0-9,]*)\]")
ARRAY_WITH_LAYOUT = re.compile(ARRAY.pattern + r"(\{[^}]*\})?")
INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
ROW_TILING = re.compile(r'ragged_dot_tiling="(\d+),')  # libtpu's grouped product: rows, contracted, columns
COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "ragged-all-to-all")
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id", "replica-id",
        "opt-barrier", "add-dependency", "copy-done", "send-done", "recv-done", "iota"}
SLICES = ("dynamic-slice", "slice", "gather")
RELAYOUTS = ("copy", "bitcast", "fusion")  # inside a fusion, with one operand of the same dimensions: a relayout
BACKWARD_ATTENTION = 2.5  # five products backward (S recomputed, dP, dV, dQ, dK) for the forward's two
DEFAULT_UNIT = {"bf16": "bf16", "f16": "fp16", "f32": "fp32", "f64": "fp32", "f4e2m1fn": "fp4",
                **{t: "fp8" for t in DTYPE_BYTES if t.startswith("f8")}}


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str  # the result type text
    opcode: str
    operands: list[str]
    attrs: str  # everything after the operand list
    args: str = ""  # the operand list as written (a parameter's number)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{re.escape(key)}=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None


@dataclasses.dataclass
class Kernel:
    """One launched kernel (or a collective): its work, summed over the loop trips that run it."""

    name: str
    kind: str  # "matmul", "attention", "convolution", "memory" or a collective's opcode
    flops: float
    bytes: float
    unit: str | None  # the matmul unit of its products ("bf16", "fp16", "fp32": an fp32 product)
    count: float  # launches per step
    group: int = 1  # collectives: devices in the replica group
    asynchronous: bool = False
    nodes: int = 1  # collectives: nodes the replica group spans (1: inside a node)


def arrays(shape_text: str) -> list[tuple[str, list[int]]]:
    """(dtype, dims) of every array in a type text (a tuple lists several)."""
    return [(m.group(1), [int(d) for d in m.group(2).split(",") if d]) for m in ARRAY.finditer(shape_text)]


def nbytes(shape_text: str, in_hbm: bool = True) -> float:
    """Bytes of the arrays in a type text; with `in_hbm`, only those in HBM (a TPU program marks the arrays
    it keeps in the core's vector memory, VMEM, with memory space S(1): reading them costs no HBM traffic)."""
    total = 0.0
    for m in ARRAY_WITH_LAYOUT.finditer(shape_text):
        if in_hbm and "S(1)" in (m.group(3) or ""):
            continue
        total += DTYPE_BYTES[m.group(1)] * math.prod(int(d) for d in m.group(2).split(",") if d)
    return total


def _top_level(text: str, depth: int) -> tuple[list[int], int]:
    """Positions of the commas at depth 1 of `text` (brackets of any kind nest), and where the
    bracket open at depth 1 closes (len(text) if it does not); `depth`: how many are open at its start."""
    commas = []
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return commas, i
        elif ch == "," and depth == 1:
            commas.append(i)
    return commas, len(text)


def _split_operands(text: str) -> tuple[list[str], str, str]:
    """The operand names of `a, b, c), attrs...`, what follows the closing parenthesis, and the
    operand list as written."""
    _, end = _top_level(text, 1)
    names = re.findall(r"%([\w.\-]+)", text[:end])
    return names, text[end + 1:], text[:end]


def parse(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Computations by name (their instructions in order) and the entry computation's name."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        head = COMPUTATION.match(line)
        if head and not line.startswith(" "):
            current = head.group(2)
            computations[current] = []
            if head.group(1):
                entry = current
            continue
        if current is None or line.strip() == "}":
            continue
        m = INSTRUCTION.match(line)
        if m:
            operands, attrs, args = _split_operands(m.group(5))
            computations[current].append(Instruction(m.group(2), m.group(3), m.group(4), operands, attrs, args))
    return computations, entry


class ProgramReader:
    """Kernels of one optimized HLO module (see the module docstring)."""

    def __init__(self, text: str, fp32_unit: str = "tf32", per_node: int | None = None):
        self.computations, self.entry = parse(text)
        self.fp32_unit = fp32_unit  # the unit fp32 products run on (the platform's default precision)
        self.per_node = per_node  # devices per node (None: one node)
        self.kernels: list[Kernel] = []
        self.assembly: ShardAssembly | None = None  # built on the first all-reduce
        self.received: dict[int, int] | None = None  # receive buffers' rows: the rows filled (hlo_collectives)
        self.row_tile: int | None = None  # libtpu's grouped-product row tile (its `ragged_dot_tiling`; 0: none)

    def read(self) -> list[Kernel]:
        self._walk(self.entry, 1.0, set())
        return self.kernels

    # -- walking ---------------------------------------------------------------------------
    def _walk(self, computation: str, times: float, seen: set[str], asynchronous: bool = False) -> None:
        if computation in seen or computation not in self.computations:
            return
        seen = seen | {computation}
        shapes = {i.name: i.shape for i in self.computations[computation]}
        for ins in self.computations[computation]:
            op = ins.opcode
            if op in FREE or op.endswith("-done"):
                continue
            if op == "while":
                # XLA's windowed einsum (collective matmul) loop sends the next chunk while the product of this
                # one runs: its collective-permutes overlap the loop's kernels
                body = ins.attr("body") or ""
                self._walk(body, times * self._trips(ins, computation), seen,
                           asynchronous or "windowed_dot_general" in body)
            elif op in ("call", "async-start") and ins.attr("calls") and not self._is_collective(ins):
                self._walk(ins.attr("calls"), times, seen, asynchronous)
            elif op == "call" and ins.attr("to_apply"):  # e.g. JAX's scaled_matmul around cuDNN's block-scaled GEMM
                self._walk(ins.attr("to_apply"), times, seen, asynchronous)
            elif op == "call-start" and ins.attr("to_apply"):
                # a computation started on another engine (TPU7x offloads its collectives to the SparseCore,
                # async_execution_thread="sparsecore"): what it runs overlaps the TensorCore's kernels
                self._walk(ins.attr("to_apply"), times, seen, asynchronous=True)
            elif op == "conditional":
                self._walk_costliest(ins, times, seen)
            elif self._is_collective(ins):
                self.kernels.append(self._collective(ins, shapes, times, asynchronous, computation))
            else:
                self.kernels.append(self._kernel(ins, shapes, times))
                if op == "fusion":  # a TPU program's async collective fusion: a collective runs beside the kernel
                    body = self.computations.get(ins.attr("calls") or "", [])
                    inner = {i.name: i.shape for i in body}
                    self.kernels += [self._collective(i, inner, times, True, ins.attr("calls") or "")
                                     for i in body if self._is_collective(i)]

    def _trips(self, loop: Instruction, computation: str) -> int:
        """A while loop's trip count: XLA GPU's `known_trip_count`, else (a TPU program) read from its
        condition, `counter < N` (or <=, !=) with the counter's start from the loop's initial tuple when it
        is a constant (0 otherwise); 1 where the condition is not of that form."""
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
        if known:
            return int(known.group(1))
        cond = {i.name: i for i in self.computations.get(loop.attr("condition") or "", [])}
        compare = next((i for i in reversed(list(cond.values())) if i.opcode == "compare"), None)
        direction = re.search(r"direction=(\w+)", compare.attrs) if compare else None
        if compare is None or direction is None or len(compare.operands) != 2:
            return 1
        counter, bound = (cond.get(o) for o in compare.operands)
        if counter is None or bound is None or bound.opcode != "constant" or counter.opcode != "get-tuple-element":
            return 1
        index = re.search(r"index=(\d+)", counter.attrs)
        start = 0
        outer = {i.name: i for i in self.computations.get(computation, [])}
        init = outer.get(loop.operands[0]) if loop.operands else None
        if index and init is not None and init.opcode == "tuple" and int(index.group(1)) < len(init.operands):
            first = _through_copies(outer, init.operands[int(index.group(1))])
            if first is not None and first.opcode == "constant" and _integer(first.args) is not None:
                start = _integer(first.args)
        end = _integer(bound.args)
        if end is None:
            return 1
        step = self._step(loop.attr("body") or "", int(index.group(1))) if index else 1
        span = {"LT": end - start, "NE": end - start, "LE": end - start + 1}.get(direction.group(1), 1)
        return max(1, -(-span // step))

    def _step(self, body: str, index: int) -> int:
        """What a loop body adds to its counter (tuple element `index`) each trip: XLA's windowed einsum loops
        (a TPU program's collective matmuls) run two chunks a trip and count by 2. 1 unless the body's result
        element is `counter + constant`, either seen through copies (libtpu copies the counter in some layouts'
        loops: read without them, such a loop ran twice its trips)."""
        inner = {i.name: i for i in self.computations.get(body, [])}
        root = self.computations[body][-1] if self.computations.get(body) else None
        if root is None or root.opcode != "tuple" or index >= len(root.operands):
            return 1
        add = inner.get(root.operands[index])
        if add is None or add.opcode != "add" or len(add.operands) != 2:
            return 1
        for a, b in (add.operands, add.operands[::-1]):
            counter, constant = _through_copies(inner, a), _through_copies(inner, b)
            if (counter is not None and counter.opcode == "get-tuple-element" and f"index={index}" in counter.attrs
                    and constant is not None and constant.opcode == "constant"):
                value = _integer(constant.args)
                return value if value and value > 0 else 1
        return 1

    def _walk_costliest(self, ins: Instruction, times: float, seen: set[str]) -> None:
        branches = re.findall(r"%([\w.\-]+)", (re.search(r"branch_computations=\{([^}]*)\}", ins.attrs) or
                                              re.search(r"(true_computation=%[\w.\-]+, false_computation=%[\w.\-]+)",
                                                        ins.attrs) or ["", ""])[1] if ins.attrs else "")
        best: list[Kernel] = []
        for branch in branches:
            sub = copy.copy(self)  # the same program and what was read of it, its own kernels
            sub.entry, sub.kernels = branch, []
            sub._walk(branch, times, seen)
            if sum(k.flops + k.bytes for k in sub.kernels) > sum(k.flops + k.bytes for k in best):
                best = sub.kernels
        self.kernels += best

    def _assembly(self) -> ShardAssembly:
        if self.assembly is None:
            self.assembly = ShardAssembly(self.computations)
        return self.assembly

    @staticmethod
    def _is_collective(ins: Instruction) -> bool:
        return ins.opcode.removesuffix("-start") in COLLECTIVES

    # -- one kernel ------------------------------------------------------------------------
    def _kernel(self, ins: Instruction, shapes: dict[str, str], times: float) -> Kernel:
        flops, unit, kind = 0.0, None, "memory"
        read = [nbytes(shapes.get(o, "")) for o in ins.operands]
        written = nbytes(ins.shape)
        if ins.opcode == "fusion" and ins.attr("calls"):
            flops, unit, kind, read, written = self._fusion(ins, read, written)
        elif ins.opcode == "custom-call":
            flops, unit, kind, written = self._custom_call(ins, shapes, written)
        elif ins.opcode == "dot":
            flops, unit = self._dot(ins, shapes)
            kind = "matmul"
        elif ins.opcode == "convolution":
            flops, unit = self._convolution(ins, [shapes.get(o, "") for o in ins.operands]), self._unit(ins.shape)
            kind = "convolution"
        elif ins.opcode in ("dynamic-update-slice", "dynamic-update-slice-start") and len(ins.operands) > 1:
            # in place (the -start form: an asynchronous copy, e.g. an activation offloaded to the host)
            read, written = read[1:2], read[1] if len(read) > 1 else written
        elif ins.opcode in ("dynamic-slice-start", "copy-start", "slice-start"):
            # asynchronous: ((operands) or operand, result, context); the result's bytes move once (a TPU
            # program prefetching into VMEM, or from the host)
            parts = _tuple_parts(ins.shape)
            read, written = [], nbytes(parts[1] if len(parts) > 1 else ins.shape, in_hbm=False)
        elif ins.opcode == "scatter" and len(ins.operands) > 2:  # in place: indices and updates read, updates written
            read, written = read[1:3], read[2]
        return Kernel(ins.name, kind, flops * times, (sum(read) + written) * times, unit, times)

    def _fusion(self, ins: Instruction, read: list[float], written: float):
        body = self.computations.get(ins.attr("calls"), [])
        inner = {i.name: i.shape for i in body}
        params = {int(i.args): i.name for i in body if i.opcode == "parameter" and i.args.strip().isdigit()}
        users: dict[str, list[Instruction]] = {}
        for i in body:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        # an operand seen through a relayout (a copy, a bitcast, a nested fusion of it alone with its dimensions:
        # libtpu retiles a scanned stack that way) is still that operand: a slice of the view reads a slice
        view_of = {name: index for index, name in params.items()}
        for i in body:
            if (i.opcode in RELAYOUTS and len(i.operands) == 1 and i.operands[0] in view_of
                    and [d for _, d in arrays(i.shape)] == [d for _, d in arrays(inner.get(i.operands[0], ""))]):
                view_of[i.name] = view_of[i.operands[0]]
        for index, name in params.items():  # an operand only sliced costs its slices
            views = {n for n, k in view_of.items() if k == index}
            used = [u for v in views for u in users.get(v, []) if u.name not in views]
            if used and index < len(read) and all(u.opcode in SLICES and u.operands[0] in views for u in used):
                read[index] = sum(nbytes(u.shape) for u in used)
        root = body[-1] if body else None
        if any(i.opcode == "custom-call" and 'custom_call_target="AsyncCollective' in i.attrs for i in body) and not any(
                i.opcode in ("dot", "convolution") for i in body):
            return 0.0, None, "memory", [0.0] * len(read), 0.0  # the start or end of a TPU async collective: its own
        carried = {i.name for i in body if self._is_collective(i)}
        if carried and root is not None and root.opcode == "tuple":
            # an async collective fusion (TPU): the collective's operands and result, and the buffers the fusion
            # hands back untouched, are the collective's traffic (counted with it), not the kernel's
            for index, name in params.items():
                if index < len(read) and all(u.name in carried or u is root for u in users.get(name, [])):
                    read[index] = 0.0
            written = sum(nbytes(inner.get(o, "")) for o in root.operands if o not in carried and o not in params.values())
        updates = [i for i in body if i.opcode in ("dynamic-update-slice", "scatter")]
        if updates and root is not None and root.opcode in ("dynamic-update-slice", "scatter", "tuple", "bitcast"):
            written = 0.0
            for u in updates:  # only the update is written, and the buffer updated in place is not read
                index = view_of.get(u.operands[0])
                if u.opcode == "scatter" and (index is None or len(u.operands) < 3):
                    written += nbytes(u.shape)  # a scatter into a buffer made inside the fusion writes it whole
                    continue
                written += nbytes(inner.get(u.operands[1 if u.opcode == "dynamic-update-slice" else -1], ""))
                if index is not None and index < len(read):
                    read[index] = 0.0
        flops, units, kind = 0.0, [], "memory"
        groups = _masked_groups(body, root, self._received(), self._row_tile())
        for i in body:
            if i.opcode == "dot":
                f, u = self._dot(i, inner)
                flops, kind = flops + f, "matmul"
                units.append(u)
            elif i.opcode == "convolution":
                flops += self._convolution(i, [inner.get(o, "") for o in i.operands])
                kind = "convolution"
                units.append(self._unit(inner.get(i.operands[0], i.shape)))
        return flops / groups, (units[0] if units else None), kind, read, written

    def _custom_call(self, ins: Instruction, shapes: dict[str, str], written: float):
        target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
        target = target.group(1) if target else ""
        results = arrays(ins.shape)
        if "workspace" in ins.attrs or (len(results) > 1 and results[-1][0] in ("s8", "u8")):
            written -= DTYPE_BYTES[results[-1][0]] * math.prod(results[-1][1])  # scratch, not HBM traffic
        operands = [shapes.get(o, "") for o in ins.operands]
        if "cublas" in target or "gemm" in target.lower():
            return self._gemm(ins, operands), self._unit(operands[0] if operands else ins.shape), "matmul", written
        if target == "__cudnn$blockScaledDot":  # MXFP8 / NVFP4 on Blackwell: lhs [B, M, K] x rhs [B, N, K]
            lhs, out = (arrays(operands[0]) if operands else []), arrays(ins.shape)
            flops = 2.0 * math.prod(out[0][1]) * lhs[0][1][-1] if lhs and out else 0.0
            return flops, self._unit(operands[0] if operands else ins.shape), "matmul", written
        if "fmha" in target or "dot_product_attention" in target:
            return self._attention(ins, operands, backward="Backward" in target), self._unit(
                operands[0] if operands else ins.shape), "attention", written
        if "conv" in target.lower():
            return self._convolution(ins, operands), self._unit(operands[0] if operands else ins.shape), \
                "convolution", written
        if target == "tpu_custom_call" and ins.name.startswith("splash_mha"):
            return self._splash(ins, operands), self._unit(ins.shape), "attention", written
        if target == "tpu_custom_call" and re.search(r'op_name="[^"]*ragged-dot-none', ins.attrs):
            return self._grouped_gemm(ins, operands), self._unit(ins.shape), "matmul", written
        return 0.0, None, "memory", written

    # -- FLOPs -----------------------------------------------------------------------------
    def _unit(self, shape_text: str) -> str | None:
        found = arrays(shape_text)
        if not found:
            return None
        unit = DEFAULT_UNIT.get(found[0][0], "bf16")
        return self.fp32_unit if unit == "fp32" else unit

    def _dot(self, ins: Instruction, shapes: dict[str, str]) -> tuple[float, str | None]:
        lhs = arrays(shapes.get(ins.operands[0], "")) if ins.operands else []
        dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
        contracted = math.prod(lhs[0][1][int(d)] for d in dims.group(1).split(",") if d) if (lhs and dims) else 1
        out = arrays(ins.shape)
        unit = self._unit(shapes.get(ins.operands[0], "")) if ins.operands else None
        if "HIGHEST" in ins.attrs and unit == self.fp32_unit:
            unit = "fp32"
        return 2.0 * (math.prod(out[0][1]) if out else 0) * contracted, unit

    def _gemm(self, ins: Instruction, operands: list[str]) -> float:
        lhs = arrays(operands[0]) if operands else []
        config = _backend_config(ins.attrs).get("gemm_backend_config", {})
        dims = config.get("dot_dimension_numbers", {}).get("lhs_contracting_dimensions", [])
        contracted = math.prod(lhs[0][1][int(d)] for d in dims) if lhs and dims else 1
        out = arrays(ins.shape)
        return 2.0 * (math.prod(out[0][1]) if out else 0) * contracted

    def _attention(self, ins: Instruction, operands: list[str], backward: bool) -> float:
        q = arrays(operands[0]) if operands else []
        config = _backend_config(ins.attrs).get("cudnn_fmha_backend_config", {})
        scores = [int(d) for d in config.get("intermediate_tensor_shape", {}).get("dimensions", [])]
        if not q or len(scores) < 4:
            return 0.0
        forward = 4.0 * math.prod(q[0][1]) * scores[-1]
        if config.get("mask_type") == "CAUSAL":
            forward /= 2
        return forward * (BACKWARD_ATTENTION if backward else 1.0)

    def _grouped_gemm(self, ins: Instruction, operands: list[str]) -> float:
        """libtpu's grouped product (its Mosaic kernel for `ragged_dot`): rows (M, K) by the groups' weights
        (G, K, N) into (M, N), each row multiplied by its own group's weights only: 2 x M x K x N, M the rows
        its groups fill (at an even spread where the rows are a ragged all-to-all's receive buffer) in the
        whole row tiles the kernel computes (`tiled_rows`, at the tile its `ragged_dot_tiling` states)."""
        out = arrays(ins.shape)
        if not out or len(out[0][1]) != 2:
            return 0.0
        m, n = out[0][1]
        lhs = next((dims for s in operands for _, dims in arrays(s)[:1] if len(dims) == 2 and dims[0] == m), None)
        weights = next((dims for s in operands for _, dims in arrays(s)[:1] if len(dims) == 3 and dims[-1] == n), None)
        stated = ROW_TILING.search(ins.attrs)
        tile = int(stated.group(1)) if stated else self._row_tile()
        rows = tiled_rows(self._received().get(m, m), weights[0] if weights else 1, tile)
        return 2.0 * rows * n * lhs[1] if lhs else 0.0

    def _received(self) -> dict[int, int]:
        if self.received is None:
            self.received = received_buffers(self.computations)
        return self.received

    def _row_tile(self) -> int:
        """The row tile libtpu's grouped products state in this program (their `ragged_dot_tiling`; the
        smallest where they differ), 0 where none does."""
        if self.row_tile is None:
            tiles = [int(m.group(1)) for body in self.computations.values() for i in body
                     if "ragged_dot_tiling" in i.attrs for m in [ROW_TILING.search(i.attrs)] if m]
            self.row_tile = min((t for t in tiles if t), default=0)
        return self.row_tile

    def _splash(self, ins: Instruction, operands: list[str]) -> float:
        """TPU splash attention (a Pallas kernel, causal: the blocks above the diagonal are skipped), from its
        query-shaped (B, H, T, Dh) operand: forward 2 products (4 x B x H x T^2 x Dh / 2); backward its dK/dV
        kernel recomputes the scores and takes 4 (8 x ... / 2), its dQ kernel 3 (6 x ... / 2)."""
        q = next((dims for s in operands for _, dims in arrays(s)[:1] if len(dims) == 4), None)
        if q is None:
            return 0.0
        products = 3 if "dq" in ins.name else 4 if "dkv" in ins.name else 2
        return 2.0 * products * math.prod(q) * q[2] / 2

    def _convolution(self, ins: Instruction, operands: list[str]) -> float:
        """2 x output batch x output features x input features per group x the (output position, kernel
        tap) pairs that meet the input, per spatial dimension: exact under padding, strides and dilations,
        so that the batched products a TPU program writes as convolutions (a batch dimension as a window
        over padding) count as the products they are."""
        labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
        tensors = [arrays(s)[0][1] for s in operands[:2] if arrays(s)] + [d for _, d in arrays(ins.shape)[:1]]
        if not labels or len(tensors) < 3:
            return 0.0
        lhs, rhs, out = tensors
        lhs_l, rhs_l, out_l = labels.groups()
        if len(lhs_l) != len(lhs) or len(rhs_l) != len(rhs) or len(out_l) != len(out) or "o" not in rhs_l:
            return 0.0
        window = _window(ins.attrs)
        taps = 1.0
        for d in sorted(c for c in out_l if c.isdigit()):
            w = {k: v[int(d)] if int(d) < len(v) else None for k, v in window.items()}
            taps *= _valid_pairs(in_size=lhs[lhs_l.index(d)], out_size=out[out_l.index(d)],
                                 size=w["size"] or rhs[rhs_l.index(d)], stride=w["stride"] or 1,
                                 pad_low=w["pad"] or 0, lhs_dilate=w["lhs_dilate"] or 1,
                                 rhs_dilate=w["rhs_dilate"] or 1)
        return 2.0 * out[out_l.index("b")] * rhs[rhs_l.index("o")] * rhs[rhs_l.index("i")] * taps

    # -- collectives -----------------------------------------------------------------------
    def _collective(self, ins: Instruction, shapes: dict[str, str], times: float, asynchronous: bool = False,
                    computation: str = "") -> Kernel:
        kind = ins.opcode.removesuffix("-start")
        if kind == "all-reduce" and self._assembly().gathers(computation, ins.operands):
            kind = ALL_REDUCE_GATHER  # shards written into zeros and summed: an all-gather (hlo_collectives)
        operand_bytes = sum(nbytes(shapes.get(o, ""), in_hbm=False) for o in ins.operands)  # over the links
        result = ins.shape
        if ins.opcode.endswith("-start") and result.startswith("("):  # (operands, results[, scratch])
            inner = _tuple_parts(result)
            result = inner[1] if len(inner) > 1 else result
        # an all-gather sends its result's bytes round the ring; the others (a reduce-scatter too) their operands'
        moved = nbytes(result, in_hbm=False) if kind == "all-gather" else operand_bytes
        if kind == RAGGED_ALL_TO_ALL:  # the rows sent at an even spread (the smaller of rows and receive buffer)
            moved = min(nbytes(shapes.get(o, ""), in_hbm=False) for o in ins.operands[:2]) if ins.operands else 0.0
        members = first_group(ins.attrs)
        nodes = len({d // self.per_node for d in members}) if members and self.per_node else 1
        return Kernel(ins.name, kind, 0.0, moved * times, None, times, group=group_size(ins.attrs),
                      asynchronous=asynchronous or ins.opcode.endswith("-start"), nodes=nodes)


def _through_copies(instructions: dict[str, Instruction], name: str) -> Instruction | None:
    """The instruction `name` is a copy (or chain of copies) of, in the same computation."""
    ins = instructions.get(name)
    for _ in range(8):
        if ins is None or ins.opcode != "copy" or not ins.operands:
            return ins
        ins = instructions.get(ins.operands[0])
    return ins


def _integer(text: str) -> int | None:
    return int(text) if re.fullmatch(r"-?\d+", text.strip()) else None


def _window(attrs: str) -> dict[str, list[int]]:
    """A convolution's window attribute, per spatial dimension: size, stride, low padding and dilations."""
    m = re.search(r"window=\{([^}]*)\}", attrs)
    fields = dict(re.findall(r"(\w+)=([\w\-x]+)", m.group(1))) if m else {}
    out = {}
    for key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
        out[key] = [int(v) for v in fields[key].split("x")] if key in fields else []
    out["pad"] = [int(v.split("_")[0]) for v in fields["pad"].split("x")] if "pad" in fields else []
    return out


def _valid_pairs(*, in_size: int, out_size: int, size: int, stride: int, pad_low: int, lhs_dilate: int,
                 rhs_dilate: int) -> int:
    """How many (output position, kernel tap) pairs of one spatial dimension read an input element: the
    tap's position o x stride + k x rhs_dilate - pad_low in the dilated input lies on an element."""
    last = (in_size - 1) * lhs_dilate
    pairs = 0
    for k in range(size):
        shift = k * rhs_dilate - pad_low  # input position of output 0 under this tap
        lo = -(shift // stride) if shift < 0 else 0  # the first output position whose tap is past the padding
        hi = min(out_size - 1, (last - shift) // stride) if last - shift >= 0 else -1
        if hi < lo:
            continue
        if lhs_dilate == 1:
            pairs += hi - lo + 1
            continue
        step = lhs_dilate // math.gcd(stride, lhs_dilate)
        first = next((o for o in range(lo, min(hi, lo + step - 1) + 1) if (o * stride + shift) % lhs_dilate == 0), None)
        if first is not None:
            pairs += (hi - first) // step + 1
    return pairs


def _tuple_parts(text: str) -> list[str]:
    """The top-level elements of a tuple type text `(a, (b, c), d)`."""
    text = text.strip()
    if not text.startswith("("):
        return [text]
    commas, end = _top_level(text[1:], 1)
    bounds = [-1, *commas, end]
    parts = [text[1:][a + 1:b] for a, b in zip(bounds, bounds[1:])]
    return [p.strip() for p in parts if p.strip()]


def _backend_config(attrs: str) -> dict[str, Any]:
    start = attrs.find("backend_config=")
    if start < 0:
        return {}
    text = attrs[start + len("backend_config="):]
    try:
        return json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
        return {}


def read_program(text: str, fp32_unit: str = "tf32", per_node: int | None = None) -> list[Kernel]:
    """The kernels and collectives of an optimized HLO module's text (`per_node`: devices per node,
    for the nodes each collective spans; None: one node)."""
    return ProgramReader(text, fp32_unit, per_node).read()


def pack(kernels: list[Kernel]) -> list[list[Any]]:
    """Kernels as compact rows for a JSON cache, alike ones merged (their launches added):
    [kind, flops per launch, bytes per launch, unit, launches, group, asynchronous, nodes]."""
    merged: dict[tuple, float] = {}
    for k in kernels:
        per = max(k.count, 1e-12)
        key = (k.kind, round(k.flops / per), round(k.bytes / per), k.unit, k.group, k.asynchronous, k.nodes)
        merged[key] = merged.get(key, 0.0) + k.count
    return [[kind, flops, size, unit, count, group, asynchronous, nodes]
            for (kind, flops, size, unit, group, asynchronous, nodes), count in merged.items()]


def unpack(rows: list[list[Any]]) -> list[Kernel]:
    return [Kernel(f"{kind}#{i}", kind, flops * count, size * count, unit, count, group, asynchronous,
                   row[7] if len(row) > 7 else 1)
            for i, row in enumerate(rows) for (kind, flops, size, unit, count, group, asynchronous) in [row[:7]]]


def tiled_rows(rows: int, groups: int, tile: int) -> float:
    """The rows a grouped kernel computes for `rows` rows sorted into `groups` groups, in row tiles of `tile`
    (libtpu's `ragged_dot`, megablox's `gmm`: a tile is computed whole, and a tile two groups share is
    computed once for each). Its tiles are ceil(rows / tile) plus one for each boundary between two groups
    that falls inside a tile: routed counts are not multiples of the tile, so every boundary is taken to,
    between the groups the rows fill when routed evenly at random (G (1 - (1 - 1/G)^rows) of them). The
    kernel's own bound on its tiles is the same: rows / tile + G - 1 (its metadata's length). `rows` itself
    where no tile is known (0)."""
    if tile <= 0 or rows <= 0:
        return float(rows)
    filled = groups * (1.0 - (1.0 - 1.0 / groups) ** rows) if groups > 1 else 1.0
    return (math.ceil(rows / tile) + max(0.0, filled - 1.0)) * tile


def _masked_groups(body: list[Instruction], root: Instruction | None, received: dict[int, int],
                   tile: int = 0) -> float:
    """G where the fusion is libtpu's form of a grouped product's transpose (a `ragged_dot`'s weight gradient):
    both inputs masked per group by a pred (G, M) parameter and one convolution over all G x M rows into the
    groups' (G, K, N). Each row belongs to one group, so the work is a grouped GEMM's, 1/G of the product's
    shape; where the M rows are a ragged all-to-all's receive buffer, of which the groups fill `received[M]`,
    that share of it too; in whole row tiles of `tile` (`tiled_rows`; the program's grouped-product tile, 0:
    none known). The divisor of the convolution's FLOPs; 1 for every other fusion."""
    if root is None or root.opcode != "convolution":
        return 1
    out = arrays(root.shape)
    masks = [dims for i in body if i.opcode == "parameter" for dtype, dims in arrays(i.shape)[:1]
             if dtype == "pred" and len(dims) == 2]
    if not out or len(out[0][1]) != 3:
        return 1
    groups = out[0][1][0]
    for g, m in masks:
        if g == groups and (g > 1 or m in received):
            return g * m / tiled_rows(received.get(m, m), g, tile)
    return 1
