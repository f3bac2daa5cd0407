"""What a collective in an optimized HLO program spans and what it really moves: the devices of its
replica groups in every form XLA prints them, and the all-reduces that are gathers.

An all-reduce whose operands are buffers of zeros with each device's shard written into them (a
dynamic-update-slice into a broadcast zero, seen through copies, bitcasts, conversions and the
parameters of the fusions and calls it was passed into) sums one shard per device into the whole: an
all-gather written as an all-reduce. With its default flags libtpu compiles FSDP's weight gathers that way
for TPU7x and v4 (for v5p and v6e as all-gathers); PREFER_ALL_GATHER compiles them as the all-gathers they
are, sending half the bytes. `ProgramReader` names such a collective ALL_REDUCE_GATHER; the step-time model
prices it as compiled (an all-reduce) unless the run sets that flag (`steptime.as_all_gathers`).

Pure text, like `hlo_cost`: the computations are `hlo_cost.parse`'s, read here by their opcodes,
operands, arguments and attributes only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

ALL_REDUCE_GATHER = "all-reduce-gather"
PREFER_ALL_GATHER = "--xla_tpu_prefer_async_allgather_to_allreduce=true"  # libtpu's flag, as recipes write it
PASS_THROUGH = ("copy", "bitcast", "convert", "copy-done", "reshape")  # the values of their operand, moved
CALLERS = ("fusion", "call", "call-start", "async-start")  # pass their operands in as a computation's parameters
DEPTH = 12  # computations followed at most (a program nests fusions and calls a few deep)


def group_size(attrs: str) -> int:
    """Devices in each replica group: `mesh['a'=8,'b'=1] {'a'}`, `[G,S]<=[N]` or `{{0,1,...},...}`."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if mesh:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        return math.prod(sizes.get(a, 1) for a in re.findall(r"'([^']+)'", mesh.group(2))) or 1
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if iota:
        return int(iota.group(2))
    listed = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
    if listed:
        return len([d for d in listed.group(1).split(",") if d]) or 1
    pairs = re.search(r"source_target_pairs=\{([^}]*)\}", attrs)
    return 2 if pairs else 1


def first_group(attrs: str) -> list[int]:
    """The device numbers of a collective's first replica group (its peers), in any of the forms
    XLA prints: `mesh['a'=4,'b'=8] {'b'}` (row-major over the mesh's axes), `[G,S]<=[dims]T(perm)`
    (an iota over dims, transposed, cut into G groups of S), `{{0,1,...},...}`, or a permute's
    `source_target_pairs={{0,1},...}`; [] when none is printed."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if mesh:
        axes = [(k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))]
        chosen = set(re.findall(r"'([^']+)'", mesh.group(2)))
        strides, stride = {}, 1
        for name, size in reversed(axes):
            strides[name] = stride
            stride *= size
        ids = [0]
        for name, size in axes:
            if name in chosen:
                ids = [i + k * strides[name] for i in ids for k in range(size)]
        return sorted(ids)
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if iota:
        size = int(iota.group(2))
        dims = [int(d) for d in iota.group(3).split(",")]
        perm = [int(d) for d in iota.group(4).split(",")] if iota.group(4) else list(range(len(dims)))
        strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
        shape = [dims[p] for p in perm]
        out = []
        for flat in range(min(size, math.prod(dims))):  # the first group: the first `size` of the transposed iota
            index, rest = [], flat
            for extent in reversed(shape):
                index.append(rest % extent)
                rest //= extent
            index.reverse()
            out.append(sum(index[j] * strides[perm[j]] for j in range(len(perm))))
        return out
    listed = re.search(r"(?:replica_groups|source_target_pairs)=\{\{([0-9,]*)\}", attrs)
    if listed:
        return [int(d) for d in listed.group(1).split(",") if d]
    return []


class ShardAssembly:
    """Reads, in one program's computations, whether an all-reduce's operands are shards written into zeros."""

    def __init__(self, computations: Mapping[str, Sequence[Any]]):
        self.computations = computations
        self.named = {c: {i.name: i for i in body} for c, body in computations.items()}
        self.callers: dict[str, list[tuple[str, Any]]] = {}
        for c, body in computations.items():
            for i in body:
                if i.opcode in CALLERS:
                    target = i.attr("calls") or i.attr("to_apply")
                    if target:
                        self.callers.setdefault(target, []).append((c, i))

    def gathers(self, computation: str, operands: Sequence[str]) -> bool:
        """Whether every one of an all-reduce's `operands` (names in `computation`) is a shard written into zeros."""
        return bool(operands) and all(self._written_into_zeros(computation, o, 0) for o in operands)

    def _origin(self, computation: str, name: str, depth: int) -> list[tuple[str, Any]]:
        """The instructions whose values `name` carries: through the pass-through ops and, from a computation's
        parameter, into every caller's operand ([] where one cannot be followed)."""
        ins = self.named.get(computation, {}).get(name)
        while ins is not None and ins.opcode in PASS_THROUGH and ins.operands:
            ins = self.named[computation].get(ins.operands[0])
        if ins is None or depth > DEPTH:
            return []
        if ins.opcode != "parameter":
            return [(computation, ins)]
        index = int(ins.args) if ins.args.strip().isdigit() else -1
        callers = self.callers.get(computation, [])
        if not callers or any(not 0 <= index < len(c.operands) for _, c in callers):
            return []
        found = [self._origin(outer, c.operands[index], depth + 1) for outer, c in callers]
        return [o for f in found for o in f] if all(found) else []

    def _written_into_zeros(self, computation: str, name: str, depth: int) -> bool:
        found = self._origin(computation, name, depth)
        return bool(found) and all(self._is_shard_in_zeros(c, ins, depth) for c, ins in found)

    def _is_shard_in_zeros(self, computation: str, ins: Any, depth: int) -> bool:
        if ins.opcode == "fusion":
            body = self.computations.get(ins.attr("calls") or "", [])
            return bool(body) and self._written_into_zeros(ins.attr("calls"), body[-1].name, depth + 1)
        if ins.opcode != "dynamic-update-slice" or not ins.operands:
            return False
        base = self._origin(computation, ins.operands[0], depth)
        return bool(base) and all(self._is_zeros(c, b) for c, b in base)

    def _is_zeros(self, computation: str, ins: Any) -> bool:
        if ins.opcode != "broadcast" or not ins.operands:
            return ins.opcode == "constant" and _zero(ins.args)
        value = self.named[computation].get(ins.operands[0])
        return value is not None and value.opcode == "constant" and _zero(value.args)


def _zero(text: str) -> bool:
    try:
        return float(text.strip()) == 0.0
    except ValueError:
        return False


RAGGED_ALL_TO_ALL = "ragged-all-to-all"


def _rows(shape_text: str) -> int | None:
    found = re.search(r"\[(\d+)", shape_text)
    return int(found.group(1)) if found else None


def ragged_rows(operand_shapes: Sequence[str]) -> tuple[int, int] | None:
    """A ragged all-to-all's (rows sent, rows of the buffer received into) from its operands' shapes (the
    rows, then the output buffer): None where they cannot be read."""
    rows = [_rows(s) for s in operand_shapes[:2]]
    return (rows[0], rows[1]) if len(rows) == 2 and None not in rows else None  # type: ignore[return-value]


def received_buffers(computations: Mapping[str, Sequence[Any]]) -> dict[int, int]:
    """The receive buffers of a program's ragged all-to-alls (dropless expert parallelism: workloads/
    expert_parallel.py), by their rows: each sized for the worst case (every slot that could reach one device),
    mapped to the rows a device's slots fill at an even spread (the rows each device sends: the dispatch's
    rows sent, the combine's rows received back). A grouped product over such a buffer computes the rows of
    its groups, the even share of them."""
    out: dict[int, int] = {}
    for body in computations.values():
        shapes = {i.name: i.shape for i in body}
        for i in body:
            if i.opcode.removesuffix("-start") != RAGGED_ALL_TO_ALL:
                continue
            found = ragged_rows([shapes.get(o, "") for o in i.operands])
            if found and max(found) > min(found):
                out[max(found)] = min(found)
    return out
