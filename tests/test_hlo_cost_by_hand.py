"""The HLO reader's FLOPs and bytes against values worked out by hand, on program text written in the
form XLA's GPU compiler prints (the cuDNN attention lines are cut from a deviceless H100 compile of the
tiny Llama): attention forward, backward and causal; products; collectives by kind, group and node;
operands sliced or updated in place. Each docstring shows the arithmetic."""

import pytest

from migration.planning.hlo_cost import BACKWARD_ATTENTION, ProgramReader, nbytes

FMHA_CONFIG = ('backend_config={{"operation_queue_id": "0", "cudnn_fmha_backend_config": {{"algorithm": {{"algo_id": '
               '"0", "math_type": "TENSOR_OP_MATH", "is_cudnn_frontend": true, "workspace_size": "0"}}, "fmha_scale": '
               '0.25, "intermediate_tensor_shape": {{"element_type": "BF16", "dimensions": ["2", "4", "64", "64"], '
               '"tuple_shapes": []}}, "is_flash_attention": true, "mask_type": "{mask}", "dropout_rate": 0.0}}}}')


def program(body: str, params: str = "") -> str:
    return f"HloModule step\n\nENTRY %main ({params}) -> f32[] {{\n{body}\n  ROOT %r = f32[] constant(0)\n}}\n"


def kernels(text: str, per_node: int | None = None) -> dict:
    return {k.name: k for k in ProgramReader(text, per_node=per_node).read()}


def attention(mask: str, backward: bool) -> str:
    q = "  %q = bf16[2,64,4,16]{3,2,1,0} parameter(0)\n  %k = bf16[2,64,2,16]{3,2,1,0} parameter(1)\n" \
        "  %v = bf16[2,64,2,16]{3,2,1,0} parameter(2)\n"
    target = "__cudnn$fmhaSoftmaxBackward" if backward else "__cudnn$fmhaSoftmax"
    result = ("(bf16[2,4,64,16]{3,1,2,0}, bf16[2,2,64,16]{3,1,2,0}, bf16[2,2,64,16]{3,1,2,0}, u8[0]{0})" if backward
              else "(bf16[2,4,64,16]{3,1,2,0}, f32[2,4,64]{2,1,0}, u8[0]{0})")
    return program(q + f'  %attn = {result} custom-call(%q, %k, %v), custom_call_target="{target}", '
                   f"api_version=API_VERSION_STATUS_RETURNING, " + FMHA_CONFIG.format(mask=mask))


@pytest.mark.parametrize("mask, backward, flops", [
    # 4 x query elements (2 x 64 x 4 x 16 = 8,192) x key length (64) = 2,097,152: QK^T and PV, 2 each
    ("NO_MASK", False, 4 * 8192 * 64),
    ("CAUSAL", False, 4 * 8192 * 64 / 2),  # the kernel skips the blocks above the diagonal
    ("NO_MASK", True, 4 * 8192 * 64 * 2.5),  # five products backward for the forward's two
    ("CAUSAL", True, 4 * 8192 * 64 / 2 * 2.5),
])
def test_cudnn_attention_counts_its_products_forward_backward_and_causal(mask, backward, flops):
    k = kernels(attention(mask, backward))["attn"]
    assert k.kind == "attention" and k.unit == "bf16" and k.flops == flops
    assert BACKWARD_ATTENTION == 2.5


def test_cudnn_attentions_bytes_are_its_operands_and_results_less_the_workspace():
    """Forward: q 8,192 x 2 B + k, v 4,096 x 2 B each = 32,768 B read; out 8,192 x 2 B + the softmax
    statistics 2 x 4 x 64 x 4 B = 18,432 B written; the u8[0] workspace is none."""
    assert kernels(attention("CAUSAL", False))["attn"].bytes == 32768 + 16384 + 2048


def test_a_dot_counts_two_flops_per_output_element_and_contracted_element():
    """[512, 256] x [256, 1024]: 2 x 512 x 1024 x 256 = 268,435,456 FLOPs; bytes 512x256x2 + 256x1024x2 read,
    512x1024x2 written = 262,144 + 524,288 + 1,048,576."""
    text = program("  %a = bf16[512,256]{1,0} parameter(0)\n  %b = bf16[256,1024]{1,0} parameter(1)\n"
                   "  %dot = bf16[512,1024]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}")
    k = kernels(text)["dot"]
    assert (k.kind, k.unit, k.flops, k.bytes) == ("matmul", "bf16", 2 * 512 * 1024 * 256, 262144 + 524288 + 1048576)


@pytest.mark.parametrize("dtype, attrs, unit", [
    ("bf16", "", "bf16"),
    ("f16", "", "fp16"),
    ("f32", "", "tf32"),  # the platform's default precision runs fp32 products on TF32
    ("f32", ", operand_precision={HIGHEST,HIGHEST}", "fp32"),  # HIGHEST asks for true fp32
    ("f8e4m3fn", "", "fp8"),
])
def test_a_products_unit_follows_its_operands_type_and_precision(dtype, attrs, unit):
    text = program(f"  %a = {dtype}[64,64]{{1,0}} parameter(0)\n  %b = {dtype}[64,64]{{1,0}} parameter(1)\n"
                   f"  %dot = f32[64,64]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}{attrs}")
    assert kernels(text)["dot"].unit == unit


COLLECTIVES = """\
  %x = bf16[1024,1024]{1,0} parameter(0)
  %ar = bf16[1024,1024]{1,0} all-reduce(%x), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %ag = bf16[8192,1024]{1,0} all-gather(%x), replica_groups=[2,8]<=[16], dimensions={0}
  %rs = bf16[128,1024]{1,0} reduce-scatter(%x), replica_groups=[2,8]<=[16], dimensions={0}, to_apply=%add
  %ags = (bf16[1024,1024]{1,0}, bf16[4096,1024]{1,0}) all-gather-start(%x), replica_groups=mesh['a'=4,'b'=4] {'b'}, dimensions={0}
  %agd = bf16[4096,1024]{1,0} all-gather-done(%ags)
  %cp = bf16[1024,1024]{1,0} collective-permute(%x), source_target_pairs={{0,1},{1,2}}
  %wide = bf16[1024,1024]{1,0} all-reduce(%x), replica_groups={{0,8}}, to_apply=%add"""


def test_each_collective_moves_the_bytes_its_ring_sends_over_its_group():
    """x is 1024 x 1024 bf16 = 2 MiB. An all-reduce moves its operand (2 MiB) in a group of 8; an
    all-gather its result (8 x 2 MiB = 16 MiB) in a group of 8 (the iota [2,8] is 2 groups of 8); a
    reduce-scatter its operand (2 MiB, not the 2/8 MiB it keeps); the asynchronous all-gather its result
    (4 x 2 MiB) in a group of 4 (axis b of a 4 x 4 mesh); a permute its operand between 2."""
    mib2 = 1024 * 1024 * 2
    k = kernels(program(COLLECTIVES))
    assert (k["ar"].kind, k["ar"].bytes, k["ar"].group, k["ar"].asynchronous) == ("all-reduce", mib2, 8, False)
    assert (k["ag"].bytes, k["ag"].group) == (8 * mib2, 8)
    assert (k["rs"].kind, k["rs"].bytes, k["rs"].group) == ("reduce-scatter", mib2, 8)
    assert (k["ags"].kind, k["ags"].bytes, k["ags"].group, k["ags"].asynchronous) == ("all-gather", 4 * mib2, 4, True)
    assert (k["cp"].bytes, k["cp"].group) == (mib2, 2)
    assert all(c.flops == 0 and c.count == 1 for c in k.values())


def test_a_group_spans_the_nodes_its_device_numbers_fall_in():
    """8 GPUs per node: {0..7} is one node; {0, 8} two; the iota [2,8]<=[16] groups 0-7 and 8-15: one
    node each; mesh 4 x 4 on axis b: devices 0-3, one node. With 2 GPUs per node {0..7} spans 4."""
    eight = kernels(program(COLLECTIVES), per_node=8)
    assert {n: eight[n].nodes for n in ("ar", "ag", "ags", "wide")} == {"ar": 1, "ag": 1, "ags": 1, "wide": 2}
    assert kernels(program(COLLECTIVES), per_node=2)["ar"].nodes == 4
    assert kernels(program(COLLECTIVES))["wide"].nodes == 1  # no node size given: one node


def test_an_update_in_place_costs_the_update_not_the_buffer():
    """A dynamic-update-slice of a [64, 128, 256] bf16 stack (4 MiB) with one [1, 128, 256] layer (64 KiB):
    the layer is read and written (2 x 65,536 B); the stack is neither read nor written whole."""
    text = program("  %stack = bf16[64,128,256]{2,1,0} parameter(0)\n  %layer = bf16[1,128,256]{2,1,0} parameter(1)\n"
                   "  %i = s32[] parameter(2)\n  %z = s32[] constant(0)\n"
                   "  %dus = bf16[64,128,256]{2,1,0} dynamic-update-slice(%stack, %layer, %i, %z, %z)")
    assert kernels(text)["dus"].bytes == 2 * 65536


def test_a_fusion_that_only_slices_an_operand_reads_the_slice():
    """The fusion takes a [64, 128, 256] bf16 stack and a [128, 256] bf16 input, slices one [1, 128, 256]
    layer and adds: reads 65,536 (the slice) + 65,536 (the input), writes 65,536."""
    text = """HloModule step

%fused (p0: bf16[64,128,256], p1: bf16[128,256], p2: s32[]) -> bf16[128,256] {
  %p0 = bf16[64,128,256]{2,1,0} parameter(0)
  %p1 = bf16[128,256]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %c = s32[] constant(0)
  %ds = bf16[1,128,256]{2,1,0} dynamic-slice(%p0, %p2, %c, %c), dynamic_slice_sizes={1,128,256}
  %b = bf16[128,256]{1,0} bitcast(%ds)
  ROOT %add = bf16[128,256]{1,0} add(%b, %p1)
}

ENTRY %main (stack: bf16[64,128,256], x: bf16[128,256], i: s32[]) -> bf16[128,256] {
  %stack = bf16[64,128,256]{2,1,0} parameter(0)
  %x = bf16[128,256]{1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = bf16[128,256]{1,0} fusion(%stack, %x, %i), kind=kLoop, calls=%fused
}
"""
    k = kernels(text)["f"]
    assert k.bytes == 65536 + 65536 + 4 + 65536 and k.flops == 0 and k.kind == "memory"


@pytest.mark.parametrize("shape, expected", [
    ("bf16[3,5]{1,0}", 30), ("f32[2,2]{1,0}", 16), ("(f16[4]{0}, s8[10]{0})", 18), ("f8e4m3fn[8]{0}", 8),
    ("s4[8]{0}", 4), ("pred[]", 1), ("f32[128]{0:S(1)}", 0),  # an array the TPU keeps in VMEM moves no HBM bytes
])
def test_bytes_of_a_type_text(shape, expected):
    assert nbytes(shape) == expected
