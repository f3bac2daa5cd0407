"""The dropless expert-parallel exchange (workloads/expert_parallel.py) on 4 CPU devices, against the same
routing worked out by hand in numpy: every slot reaches the device that holds its expert, is computed there by
that expert, and comes back to its own row; the receive buffer holds the worst case (nothing ever dropped,
however the router spreads the slots). And the program reader's side: a ragged all-to-all moves the rows a
device sends, a grouped product over its receive buffer computes the rows its groups fill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from migration.planning.hlo_collectives import ragged_rows, received_buffers
from migration.planning.hlo_cost import ProgramReader, parse, tiled_rows
from tests.test_hlo_cost_by_hand import GROUPED_PROGRAM
from workloads.expert_parallel import EXPERT_AXIS, exchange_slots, receive_rows

DEVICES, EXPERTS, TOP_K, TOKENS, WIDTH = 4, 8, 2, 12, 3


def exchanged(experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each device's slots (its tokens' top-k experts, rows sorted by expert) through `exchange_slots`, where
    the expert computing a row multiplies it by (100 + its global number) and adds its local rank in the
    group it was computed in (that rank read back tells nothing of the order, only that every row came home)."""
    mesh = jax.make_mesh((DEVICES,), (EXPERT_AXIS,), devices=jax.devices()[:DEVICES])
    local = EXPERTS // DEVICES

    def per_device(rows, slots):
        slots = slots.reshape(-1)
        order = jnp.argsort(slots, stable=True)
        sizes = jnp.bincount(slots, length=EXPERTS).astype(jnp.int32)
        first = jax.lax.axis_index(EXPERT_AXIS) * local

        def compute(received, group_sizes):
            expert = jnp.repeat(jnp.arange(local), group_sizes, total_repeat_length=received.shape[0])
            filled = jnp.arange(received.shape[0]) < jnp.sum(group_sizes)
            return jnp.where(filled[:, None], received * (100.0 + first + expert)[:, None], -1.0)

        out = exchange_slots(rows[order], sizes, EXPERTS, TOP_K, compute)
        return jnp.zeros_like(out).at[order].set(out)  # back in slot order

    rows = np.arange(DEVICES * TOKENS * TOP_K * WIDTH, dtype=np.float32).reshape(-1, WIDTH) + 1.0
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(EXPERT_AXIS)))  # noqa: E731
    run = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(EXPERT_AXIS), P(EXPERT_AXIS)),
                                out_specs=P(EXPERT_AXIS), check_vma=False))
    return np.asarray(run(put(rows), put(experts.reshape(DEVICES, TOKENS, TOP_K)))), rows


@pytest.mark.parametrize("spread", ["random", "all to device 0", "all to the last expert pair"])
def test_every_slot_is_computed_by_its_own_expert_and_comes_back_to_its_row(spread):
    rng = np.random.default_rng(0)
    if spread == "random":
        experts = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(DEVICES * TOKENS)])
    elif spread == "all to device 0":  # the worst case: every slot of every device to one device's experts
        experts = np.tile(np.arange(TOP_K), (DEVICES * TOKENS, 1))
    else:
        experts = np.tile(np.arange(EXPERTS - TOP_K, EXPERTS), (DEVICES * TOKENS, 1))
    got, rows = exchanged(experts.astype(np.int32))
    want = rows * (100.0 + experts.reshape(-1, 1))
    np.testing.assert_array_equal(got, want)


def test_the_receive_buffer_is_the_worst_case_one_device_can_be_sent():
    # each token sends at most min(top-k, local experts) slots to one device
    assert receive_rows(slots=64 * 8, n_experts=256, top_k=8, devices=8) == 8 * 64 * 8  # 32 local experts >= k
    assert receive_rows(slots=64 * 8, n_experts=256, top_k=8, devices=64) == 64 * 64 * 4  # 4 local experts < k
    assert receive_rows(slots=24, n_experts=8, top_k=2, devices=4) == 4 * 12 * 2


RAGGED_PROGRAM = """HloModule step

%grouped (p0: bf16[512,64], p1: bf16[2,64,128], p2: s32[2]) -> bf16[512,128] {
  %p0 = bf16[512,64]{1,0} parameter(0)
  %p1 = bf16[2,64,128]{2,1,0} parameter(1)
  %p2 = s32[2]{0} parameter(2)
  ROOT %ragged-dot-none = bf16[512,128]{1,0} custom-call(%p0, %p1, %p2), custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/shard_map/ragged_dot_general/ragged-dot-none"}
}

ENTRY %main (rows: bf16[128,64], buffer: bf16[512,64], weights: bf16[2,64,128], o: s64[4], s: s64[4]) -> bf16[512,128] {
  %rows = bf16[128,64]{1,0} parameter(0)
  %buffer = bf16[512,64]{1,0} parameter(1)
  %weights = bf16[2,64,128]{2,1,0} parameter(2)
  %o = s64[4]{0} parameter(3)
  %s = s64[4]{0} parameter(4)
  %sizes = s32[2]{0} constant({64, 64})
  %received = bf16[512,64]{1,0} ragged-all-to-all(%rows, %buffer, %o, %s, %o, %s), replica_groups={{0,1,2,3}}
  ROOT %products = bf16[512,128]{1,0} custom-call(%received, %weights, %sizes), custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/shard_map/ragged_dot_general/ragged-dot-none"}
}
"""


def test_the_reader_moves_the_rows_sent_and_computes_the_rows_the_groups_fill():
    computations, _ = parse(RAGGED_PROGRAM)
    assert received_buffers(computations) == {512: 128}
    assert ragged_rows(["bf16[128,64]{1,0}", "bf16[512,64]{1,0}"]) == (128, 512)
    kernels = ProgramReader(RAGGED_PROGRAM).read()
    (exchange,) = [k for k in kernels if k.kind == "ragged-all-to-all"]
    assert exchange.bytes == 128 * 64 * 2 and exchange.group == 4  # the 128 rows sent, not the 512-row buffer
    (products,) = [k for k in kernels if k.kind == "matmul"]
    assert products.flops == 2.0 * 128 * 64 * 128  # the 128 rows the groups fill at an even spread
    without = RAGGED_PROGRAM.replace("%received = bf16[512,64]{1,0} ragged-all-to-all(%rows, %buffer, %o, %s, %o, %s), "
                                     "replica_groups={{0,1,2,3}}", "%received = bf16[512,64]{1,0} copy(%buffer)")
    (plain,) = [k for k in ProgramReader(without).read() if k.kind == "matmul"]
    assert plain.flops == 2.0 * 512 * 64 * 128  # rows that are no receive buffer: every row counted


# -- grouped products in whole row tiles -------------------------------------------------------------------------

def tiles_visited(counts: np.ndarray, tile: int) -> int:
    """The row tiles a grouped kernel visits for groups of `counts` rows laid out one after another, each group
    visiting every tile it touches (megablox's `make_group_metadata`: ceil(end / tile) - floor(start / tile) a
    nonempty group), counted group by group."""
    ends = np.cumsum(counts)
    starts = ends - counts
    return int(np.sum((-(-ends // tile) - starts // tile)[counts > 0]))


@pytest.mark.parametrize("rows, groups, tile", [(524288, 128, 256), (4096, 128, 256), (8, 128, 256), (3000, 8, 512),
                                                (1000, 1, 256)])
def test_a_grouped_products_tiles_are_those_of_rows_routed_at_random(rows, groups, tile):
    """`tiled_rows` against the tiles counted group by group over 300 routings drawn at random (each row to one
    of the groups, evenly): within 1%, from many rows a group (Qwen3-235B's 4,096 a device's expert) to fewer
    rows than groups, where most groups are empty."""
    rng = np.random.default_rng(1)
    drawn = np.mean([tiles_visited(rng.multinomial(rows, [1.0 / groups] * groups), tile) for _ in range(300)])
    assert tiled_rows(rows, groups, tile) / tile == pytest.approx(drawn, rel=0.01)


def test_without_a_tile_every_row_counts_once():
    assert tiled_rows(4096, 128, 0) == 4096.0
    assert tiled_rows(0, 128, 256) == 0.0


TILED_PROGRAM = GROUPED_PROGRAM.replace('custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/shard_map',
                                        'custom_call_target="tpu_custom_call", frontend_attributes={ragged_dot_tiling='
                                        '"128,64,256"}, metadata={op_name="jit(step)/shard_map')


def test_the_reader_counts_libtpus_grouped_products_in_the_row_tiles_the_program_states():
    """512 rows in 8 groups, the kernel's stated row tile 128 (`ragged_dot_tiling="128,..."`): 4 tiles of rows and
    7 boundaries inside tiles, 11 x 128 = 1,408 rows computed, forward (2 x 1,408 x 256 x 64) and in the weights'
    gradient, whose masked convolution states no tile and takes the program's. Without the attribute, 512 rows."""
    assert TILED_PROGRAM.count('ragged_dot_tiling="128,64,256"') == 1
    by_name = {k.name: k for k in ProgramReader(TILED_PROGRAM).read()}
    assert by_name["ragged-dot-none"].flops == pytest.approx(2 * 1408 * 256 * 64, rel=1e-6)
    assert by_name["grad"].flops == pytest.approx(2 * 1408 * 256 * 64, rel=1e-6)
    untiled = {k.name: k for k in ProgramReader(TILED_PROGRAM.replace('ragged_dot_tiling="128,64,256"', "")).read()}
    assert untiled["ragged-dot-none"].flops == untiled["grad"].flops == 2 * 512 * 256 * 64
