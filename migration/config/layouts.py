"""How a job lays its state and its batch over the GPUs: the layout names every plan, run and compile
key uses, and the mesh each one means. The standard library only.

A layout is a mesh of three axes, outermost first, ("data", "fsdp", "tensor"), and a fourth,
"expert", between "fsdp" and "tensor" for a layout with expert parallelism:

- ``replicated``: every GPU holds the whole state; the batch is split over all of them (data
  parallelism; the gradients are all-reduced).
- ``fsdp``: the state is sharded over every GPU (ZeRO-3 / FSDP); the batch too.
- ``hybrid:G``: the state is sharded over groups of G consecutive GPUs (a node, or several nodes:
  MaxText's ``ici_fsdp`` x ``dcn_fsdp``) and replicated across the groups (``dcn_data``); the
  batch is split over all of them. The gathers stay inside a group; only the gradient reduction
  crosses groups.
- ``+epE`` after any of them (a mixture-of-experts model): expert parallelism over E GPUs, each
  holding 1/E of every MoE layer's routed experts (workloads/moe.py ``expert_parallel_spec``); the
  tokens travel to their experts and back by all-to-all. The other weights are sharded over the
  expert axis too, as FSDP (MaxText's ``ici_expert_parallelism``: the axis also shards the batch),
  unless the layout replicates the state. E consecutive GPUs: inside a node when E x T fits one,
  else whole nodes (``dcn_expert_parallelism`` on TPU slices).
- ``+tpT`` after any of them: tensor parallelism over T consecutive GPUs inside a node (Megatron's
  split of heads and hidden units, workloads/transformer.py ``tensor_parallel_spec``); the other
  axes then count groups of T GPUs (of E x T with expert parallelism).

Devices are numbered node by node, so consecutive GPUs share a node: the innermost axes are the
ones inside a node.
"""

from __future__ import annotations

import dataclasses
import re

from migration.common import ConfigError

KINDS = ("replicated", "fsdp", "hybrid")
AXES = ("data", "fsdp", "expert", "tensor")
EXPERT_AXIS, TENSOR_AXIS = "expert", "tensor"
_PATTERN = re.compile(r"^(replicated|fsdp|hybrid:(\d{1,5}))(?:\+ep(\d{1,4}))?(?:\+tp(\d{1,2}))?$")
ALLOWED = ("replicated, fsdp or hybrid:G (FSDP over groups of G GPUs, data parallelism across them), each "
           "optionally followed by +epE (expert parallelism over E GPUs: mixture-of-experts models) and +tpT "
           "(tensor parallelism over T GPUs of a node), e.g. hybrid:8+tp2 or fsdp+ep8")


@dataclasses.dataclass(frozen=True)
class Layout:
    kind: str  # one of KINDS
    group: int = 0  # hybrid: GPUs per FSDP group (a multiple of `expert` x `tensor`)
    tensor: int = 1
    expert: int = 1

    @property
    def name(self) -> str:
        base = f"hybrid:{self.group}" if self.kind == "hybrid" else self.kind
        return base + (f"+ep{self.expert}" if self.expert > 1 else "") + (f"+tp{self.tensor}" if self.tensor > 1 else "")

    @property
    def inner(self) -> int:
        """Consecutive GPUs of the model-parallel axes (expert x tensor)."""
        return self.expert * self.tensor

    def axes(self, devices: int) -> dict[str, int]:
        """Sizes of the mesh axes over `devices` GPUs (checked by `check`); "expert" only when E > 1,
        so the meshes of the layouts without experts are those they always were."""
        groups = devices // self.inner
        if self.kind == "replicated":
            data, fsdp = groups, 1
        elif self.kind == "fsdp":
            data, fsdp = 1, groups
        else:
            fsdp = self.group // self.inner
            data = groups // fsdp
        return {"data": data, "fsdp": fsdp, **({EXPERT_AXIS: self.expert} if self.expert > 1 else {}),
                TENSOR_AXIS: self.tensor}

    def shards_state(self) -> bool:
        return self.kind != "replicated"

    def state_shards(self, devices: int) -> int:
        """GPUs a parameter's bytes are divided among (FSDP's group, the expert axis and the tensor split, at
        most). A layout that replicates the state splits only the experts over the expert axis
        (`expert_shards`)."""
        a = self.axes(devices)
        return a["fsdp"] * a["tensor"] * (self.expert if self.shards_state() else 1)

    def state_fraction(self, devices: int, expert_share: float = 0.0) -> float:
        """The share of the model's state one GPU holds, when `expert_share` of the parameters are routed
        experts' (split by the expert axis even where the layout replicates the rest)."""
        return (1.0 - expert_share) / self.state_shards(devices) + expert_share / self.expert_shards(devices)

    def expert_shards(self, devices: int) -> int:
        """GPUs a routed expert weight's bytes are divided among: the expert axis, FSDP's and the tensor split."""
        a = self.axes(devices)
        return a["fsdp"] * a["tensor"] * self.expert

    def describe(self, devices: int, per_node: int) -> str:
        a = self.axes(devices)
        parts = []
        if self.kind == "replicated":
            parts.append(f"data parallelism over {a['data']} (state replicated)")
        elif self.kind == "fsdp":
            parts.append(f"FSDP over {a['fsdp'] * self.expert}" + (" (the expert axis too)" if self.expert > 1 else ""))
        else:
            nodes = self.group / per_node
            where = "one node" if nodes == 1 else (f"{nodes:g} nodes" if nodes > 1 else f"{self.group} GPUs of a node")
            parts.append(f"FSDP over groups of {self.group} GPUs ({where}) x data parallelism over {a['data']} groups")
        if self.expert > 1:
            nodes = self.inner / per_node
            where = "inside a node" if nodes <= 1 else f"across {nodes:g} nodes"
            parts.append(f"expert parallelism over {self.expert} GPUs ({where}; all-to-all dispatch)")
        if self.tensor > 1:
            parts.append(f"tensor parallelism over {self.tensor} GPUs of a node")
        return ", ".join(parts)

    def check(self, devices: int, per_node: int, field: str = "sharding") -> "Layout":
        """The layout, or ConfigError naming `field` when it cannot lay out `devices` GPUs."""
        t = self.tensor
        if t < 1 or t & (t - 1) or t > per_node or devices % t:
            raise ConfigError(field, f"+tp{t}: tensor parallelism needs a power of two up to the GPUs of a node "
                                     f"({per_node}) that divides the GPUs ({devices})")
        e, inner = self.expert, self.inner
        if e < 1 or devices % inner:
            raise ConfigError(field, f"+ep{e}: the expert split times the tensor split ({inner}) must divide the "
                                     f"GPUs ({devices})")
        if inner > per_node and inner % per_node:
            raise ConfigError(field, f"+ep{e}: expert parallelism wider than a node ({per_node} GPUs) must span whole "
                                     f"nodes: E x T a multiple of {per_node}")
        if self.kind == "hybrid":
            g = self.group
            if g < inner or g % inner or g > devices or devices % g:
                raise ConfigError(field, f"hybrid:{g}: the FSDP group must divide the GPUs ({devices}) and be a "
                                         f"multiple of the {'expert and tensor splits' if e > 1 else 'tensor split'} "
                                         f"({inner}); "
                                         f"e.g. hybrid:{max(inner, min(per_node, devices))}")
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
    return Layout(kind, int(m.group(2) or 0), int(m.group(4) or 1), int(m.group(3) or 1))


def layout_name(kind: str, group: int = 0, tensor: int = 1, expert: int = 1) -> str:
    return Layout(kind, group, tensor, expert).name
