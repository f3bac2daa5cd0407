"""All-reduces that gather: program text written as libtpu prints FSDP's weight gathers by default on TPU7x
(a shard written into a broadcast zero, then summed over the group), read as such through fusions, calls to
the SparseCore and copies, and priced as an all-gather only for a run that sets
`--xla_tpu_prefer_async_allgather_to_allreduce`. The sums of real values (gradients, a pad, a shard written
into ones) stay all-reduces."""

import gzip
from pathlib import Path

import pytest

from migration.planning import steptime
from migration.planning.hlo_collectives import ALL_REDUCE_GATHER
from migration.planning.hlo_cost import Kernel, ProgramReader

FIXTURES = Path(__file__).parent / "fixtures" / "published_tpu"
MIB2 = 1024 * 1024 * 2  # bf16[1024,1024]
HEAD = """HloModule step

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

%written (p0: bf16[1024,1024], p1: bf16[128,1024], p2: s32[]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{1,0} parameter(0)
  %p1 = bf16[128,1024]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = bf16[1024,1024]{1,0} dynamic-update-slice(%p0, %p1, %p2, %zero)
}

%offloaded (q0: bf16[1024,1024], q1: token[]) -> bf16[1024,1024] {
  %q1 = token[] parameter(1)
  %q0 = bf16[1024,1024]{1,0} parameter(0)
  ROOT %inner = bf16[1024,1024]{1,0} all-reduce(%q0), replica_groups=mesh['fsdp'=8] {'fsdp'}, to_apply=%add
}
"""


def program(body: str) -> str:
    return HEAD + ("\nENTRY %main (w: bf16[128,1024], g: bf16[1024,1024], i: s32[]) -> f32[] {\n"
                   "  %w = bf16[128,1024]{1,0} parameter(0)\n  %g = bf16[1024,1024]{1,0} parameter(1)\n"
                   "  %i = s32[] parameter(2)\n  %c0 = bf16[] constant(0)\n  %c1 = bf16[] constant(1)\n"
                   "  %zeros = bf16[1024,1024]{1,0} broadcast(%c0), dimensions={}\n"
                   "  %ones = bf16[1024,1024]{1,0} broadcast(%c1), dimensions={}\n"
                   "  %k0 = s32[] constant(0)\n"
                   f"{body}\n  ROOT %r = f32[] constant(0)\n}}\n")


def collectives(body: str) -> dict[str, Kernel]:
    return {k.name: k for k in ProgramReader(program(body)).read() if k.group > 1}


@pytest.mark.parametrize("body, name, kind", [
    # the shard written into zeros in the same computation, then summed: a gather
    ("  %d = bf16[1024,1024]{1,0} dynamic-update-slice(%zeros, %w, %i, %k0)\n"
     "  %ar = bf16[1024,1024]{1,0} all-reduce(%d), replica_groups=mesh['fsdp'=8] {'fsdp'}, to_apply=%add",
     "ar", ALL_REDUCE_GATHER),
    # through a copy and a bitcast
    ("  %d = bf16[1024,1024]{1,0} dynamic-update-slice(%zeros, %w, %i, %k0)\n  %cp = bf16[1024,1024]{0,1} copy(%d)\n"
     "  %bc = bf16[1024,1024]{1,0} bitcast(%cp)\n"
     "  %ar = bf16[1024,1024]{1,0} all-reduce(%bc), replica_groups=mesh['fsdp'=8] {'fsdp'}, to_apply=%add",
     "ar", ALL_REDUCE_GATHER),
    # a fusion writes the shard into the zeros it is passed (libtpu's convert_dynamic-update-slice_fusion)
    ("  %f = bf16[1024,1024]{1,0} fusion(%zeros, %w, %i), kind=kLoop, calls=%written\n"
     "  %ar = bf16[1024,1024]{1,0} all-reduce(%f), replica_groups=mesh['fsdp'=8] {'fsdp'}, to_apply=%add",
     "ar", ALL_REDUCE_GATHER),
    # the sum offloaded to the SparseCore: the all-reduce of the called computation's parameter
    ("  %d = bf16[1024,1024]{1,0} dynamic-update-slice(%zeros, %w, %i, %k0)\n  %t = token[] after-all()\n"
     "  %cs = ((bf16[1024,1024]{1,0}, token[]), bf16[1024,1024]{1,0}) call-start(%d, %t), "
     "async_execution_thread=\"sparsecore\", to_apply=%offloaded\n"
     "  %cd = bf16[1024,1024]{1,0} call-done(%cs)",
     "inner", ALL_REDUCE_GATHER),
    # a gradient: real values on every device
    ("  %ar = bf16[1024,1024]{1,0} all-reduce(%g), replica_groups=mesh['fsdp'=8] {'fsdp'}, to_apply=%add",
     "ar", "all-reduce"),
    # a shard written into ones: the sum adds the other devices' ones, not a gather
    ("  %d = bf16[1024,1024]{1,0} dynamic-update-slice(%ones, %w, %i, %k0)\n"
     "  %ar = bf16[1024,1024]{1,0} all-reduce(%d), replica_groups=mesh['fsdp'=8] {'fsdp'}, to_apply=%add",
     "ar", "all-reduce"),
    # a pad puts every device's values at the same place: a sum
    ("  %pd = bf16[1024,1024]{1,0} pad(%w, %c0), padding=0_896x0_0\n"
     "  %ar = bf16[1024,1024]{1,0} all-reduce(%pd), replica_groups=mesh['fsdp'=8] {'fsdp'}, to_apply=%add",
     "ar", "all-reduce"),
    # one operand gathered and one summed: the collective is an all-reduce
    ("  %d = bf16[1024,1024]{1,0} dynamic-update-slice(%zeros, %w, %i, %k0)\n"
     "  %ar = (bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) all-reduce(%d, %g), replica_groups=mesh['fsdp'=8] {'fsdp'}, "
     "to_apply=%add", "ar", "all-reduce"),
])
def test_an_all_reduce_is_a_gather_only_where_each_operand_is_a_shard_written_into_zeros(body, name, kind):
    k = collectives(body)[name]
    assert k.kind == kind
    assert k.group == 8


def test_a_gather_costs_an_all_reduce_unless_the_run_prefers_all_gathers():
    """2 MiB gathered over 8 devices at 100 GB/s with link share 1 and no fixed cost: as compiled, an
    all-reduce's 2 x 7/8 x 2 MiB = 36.7 us; with libtpu's flag, an all-gather's 7/8 x 2 MiB = 18.4 us. A real
    all-reduce keeps its price."""
    cal = steptime.Calibration(matmul=1, attention=1, memory=1, launch_s=0, link=1, collective_s=0)
    gather = Kernel("ar", ALL_REDUCE_GATHER, 0.0, MIB2, None, 1, group=8)
    summed = Kernel("g", "all-reduce", 0.0, MIB2, None, 1, group=8)
    as_compiled = steptime.collective_seconds(gather, 100e9, cal)
    assert as_compiled == pytest.approx(2 * 7 / 8 * MIB2 / 100e9)
    flagged = steptime.as_all_gathers([gather, summed])
    assert [k.kind for k in flagged] == ["all-gather", "all-reduce"]
    assert steptime.collective_seconds(flagged[0], 100e9, cal) == pytest.approx(as_compiled / 2)
    assert steptime.collective_seconds(flagged[1], 100e9, cal) == steptime.collective_seconds(summed, 100e9, cal)


def test_libtpu_gathers_llama_70b_weights_on_tpu7x_by_all_reduces_and_v6e_by_all_gathers():
    """The stored deviceless compiles of two published TPU jobs: Llama 3.1 70B on 64 TPU7x chips (FSDP over 128
    devices) gathers its weights only by all-reduces, 339 GB a device a step, which the reader finds; its real
    sums (the logits' maxima and sums, the loss) are 7.6 GB. Mistral 7B on a v6e-8 gathers by all-gathers and
    has no all-reduce that gathers."""
    def by_kind(name: str) -> dict[str, float]:
        text = gzip.decompress((FIXTURES / f"{name}.hlo.gz").read_bytes()).decode()
        out: dict[str, float] = {}
        for k in ProgramReader(text).read():
            if k.group > 1:
                out[k.kind] = out.get(k.kind, 0.0) + k.bytes
        return out

    ironwood = by_kind("tpurecipes-tpu7x-llama3.1-70b-64chips-bf16")
    assert "all-gather" not in ironwood
    assert ironwood[ALL_REDUCE_GATHER] == pytest.approx(339.26e9, rel=0.01)
    assert ironwood["all-reduce"] < 0.03 * ironwood[ALL_REDUCE_GATHER]
    trillium = by_kind("tpurecipes-v6e-mistral-7b-v6e-8-bf16")
    assert ALL_REDUCE_GATHER not in trillium and trillium["all-gather"] > 0
