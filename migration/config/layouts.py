"""How a job lays its state and its batch over the GPUs: the layout names every plan, run and compile
key uses, and the mesh each one means. The standard library only.

A layout is a mesh of three axes, outermost first, ("data", "fsdp", "tensor"):

- ``replicated``: every GPU holds the whole state; the batch is split over all of them (data
  parallelism; the gradients are all-reduced).
- ``fsdp``: the state is sharded over every GPU (ZeRO-3 / FSDP); the batch too.
- ``hybrid:G``: the state is sharded over groups of G consecutive GPUs (a node, or several nodes:
  MaxText's ``ici_fsdp`` x ``dcn_fsdp``) and replicated across the groups (``dcn_data``); the
  batch is split over all of them. The gathers stay inside a group; only the gradient reduction
  crosses groups.
- ``+tpT`` after any of them: tensor parallelism over T consecutive GPUs inside a node (Megatron's
  split of heads and hidden units, workloads/transformer.py ``tensor_parallel_spec``); the other
  axes then count groups of T GPUs.

Devices are numbered node by node, so consecutive GPUs share a node: the innermost axes are the
ones inside a node.
"""

from __future__ import annotations

import dataclasses
import re

from migration.common import ConfigError

KINDS = ("replicated", "fsdp", "hybrid")
AXES = ("data", "fsdp", "tensor")
_PATTERN = re.compile(r"^(replicated|fsdp|hybrid:(\d{1,5}))(?:\+tp(\d{1,2}))?$")
ALLOWED = ("replicated, fsdp or hybrid:G (FSDP over groups of G GPUs, data parallelism across them), each "
           "optionally followed by +tpT (tensor parallelism over T GPUs of a node), e.g. hybrid:8+tp2")


@dataclasses.dataclass(frozen=True)
class Layout:
    kind: str  # one of KINDS
    group: int = 0  # hybrid: GPUs per FSDP group (a multiple of `tensor`)
    tensor: int = 1

    @property
    def name(self) -> str:
        base = f"hybrid:{self.group}" if self.kind == "hybrid" else self.kind
        return base + (f"+tp{self.tensor}" if self.tensor > 1 else "")

    def axes(self, devices: int) -> dict[str, int]:
        """Sizes of the mesh axes over `devices` GPUs (checked by `check`)."""
        groups = devices // self.tensor
        if self.kind == "replicated":
            data, fsdp = groups, 1
        elif self.kind == "fsdp":
            data, fsdp = 1, groups
        else:
            fsdp = self.group // self.tensor
            data = groups // fsdp
        return {"data": data, "fsdp": fsdp, "tensor": self.tensor}

    def shards_state(self) -> bool:
        return self.kind != "replicated"

    def state_shards(self, devices: int) -> int:
        """GPUs a parameter's bytes are divided among (FSDP's group times the tensor split, at most)."""
        a = self.axes(devices)
        return a["fsdp"] * a["tensor"]

    def describe(self, devices: int, per_node: int) -> str:
        a = self.axes(devices)
        parts = []
        if self.kind == "replicated":
            parts.append(f"data parallelism over {a['data']} (state replicated)")
        elif self.kind == "fsdp":
            parts.append(f"FSDP over {a['fsdp']}")
        else:
            nodes = self.group / per_node
            where = "one node" if nodes == 1 else (f"{nodes:g} nodes" if nodes > 1 else f"{self.group} GPUs of a node")
            parts.append(f"FSDP over groups of {self.group} GPUs ({where}) x data parallelism over {a['data']} groups")
        if self.tensor > 1:
            parts.append(f"tensor parallelism over {self.tensor} GPUs of a node")
        return ", ".join(parts)

    def check(self, devices: int, per_node: int, field: str = "sharding") -> "Layout":
        """The layout, or ConfigError naming `field` when it cannot lay out `devices` GPUs."""
        t = self.tensor
        if t < 1 or t & (t - 1) or t > per_node or devices % t:
            raise ConfigError(field, f"+tp{t}: tensor parallelism needs a power of two up to the GPUs of a node "
                                     f"({per_node}) that divides the GPUs ({devices})")
        if self.kind == "hybrid":
            g = self.group
            if g < t or g % t or g > devices or devices % g:
                raise ConfigError(field, f"hybrid:{g}: the FSDP group must divide the GPUs ({devices}) and be a "
                                         f"multiple of the tensor split ({t}); e.g. hybrid:{min(per_node, devices)}")
            if g > per_node and g % per_node:
                raise ConfigError(field, f"hybrid:{g}: a group larger than a node must be whole nodes of {per_node}")
        return self


def parse_layout(text: str, field: str = "sharding") -> Layout:
    """A layout from its name (`Layout.name`), or ConfigError naming `field` and what is allowed."""
    m = _PATTERN.match(text) if isinstance(text, str) else None
    if not m:
        shown = repr(text)[:60]
        raise ConfigError(field, f"must be {ALLOWED}; got {shown}")
    kind = m.group(1).split(":")[0]
    return Layout(kind, int(m.group(2) or 0), int(m.group(3) or 1))


def layout_name(kind: str, group: int = 0, tensor: int = 1) -> str:
    return Layout(kind, group, tensor).name
