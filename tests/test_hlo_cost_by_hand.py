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


# -- custom calls: cuBLAS, cuDNN, Pallas -----------------------------------------------------------------------

GEMM_CONFIG = ('backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"gemm_backend_config":'
               '{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
               '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},'
               '"alpha_imag":0,"precision_config":{"operand_precision":["DEFAULT","DEFAULT"],"algorithm":"ALG_UNSET"},'
               '"epilogue":"DEFAULT","grad_x":false,"grad_y":false,"damax_output":false},"force_earliest_schedule":false}')


def test_a_cublas_gemm_counts_its_product_and_not_its_workspace():
    """A GPU compiled on the device hands its products to cuBLAS: [512, 256] x [256, 1024] bf16 with an
    s8 workspace of 4 MiB. 2 x 512 x 1024 x 256 = 268,435,456 FLOPs; bytes 262,144 + 524,288 read and
    1,048,576 written, the workspace none of them (scratch, not traffic)."""
    text = program("  %a = bf16[512,256]{1,0} parameter(0)\n  %b = bf16[256,1024]{1,0} parameter(1)\n"
                   "  %gemm = (bf16[512,1024]{1,0}, s8[4194304]{0}) custom-call(%a, %b), "
                   f'custom_call_target="__cublas$gemm", {GEMM_CONFIG}')
    k = kernels(text)["gemm"]
    assert (k.kind, k.unit, k.flops) == ("matmul", "bf16", 2 * 512 * 1024 * 256)
    assert k.bytes == 262144 + 524288 + 1048576


def test_an_fp8_cublaslt_gemm_runs_on_the_fp8_units_and_contracts_two_dimensions():
    """cuBLASLt's fp8 product of lhs [64, 8, 32] (e4m3, contracting 1 and 2: 256) with rhs [256, 128] (e5m2),
    scaled, into bf16 [64, 128]: 2 x 64 x 128 x 256 = 4,194,304 FLOPs in the fp8 unit (the lhs's type)."""
    config = GEMM_CONFIG.replace('"lhs_contracting_dimensions":["1"]', '"lhs_contracting_dimensions":["1","2"]')
    text = program("  %a = f8e4m3fn[64,8,32]{2,1,0} parameter(0)\n  %b = f8e5m2[256,128]{1,0} parameter(1)\n"
                   "  %sa = f32[] parameter(2)\n  %sb = f32[] parameter(3)\n"
                   "  %f8 = (bf16[64,128]{1,0}, s8[33554432]{0}) custom-call(%a, %b, %sa, %sb), "
                   f'custom_call_target="__cublas$lt$matmul$f8", {config}')
    k = kernels(text)["f8"]
    assert (k.kind, k.unit, k.flops) == ("matmul", "fp8", 2 * 64 * 128 * 256)


def test_a_gemm_without_dimension_numbers_is_an_outer_product():
    """No contracting dimensions given: [64, 1] x [1, 32] counts 2 x 64 x 32 x 1 = 4,096."""
    text = program("  %a = bf16[64,1]{1,0} parameter(0)\n  %b = bf16[1,32]{1,0} parameter(1)\n"
                   '  %g = bf16[64,32]{1,0} custom-call(%a, %b), custom_call_target="__cublas$gemm"')
    assert kernels(text)["g"].flops == 2 * 64 * 32


def test_blackwells_block_scaled_product_counts_its_contraction():
    """MXFP8 on Blackwell, cuDNN's block-scaled dot: lhs [2, 128, 512] x rhs [2, 256, 512] (K last) with
    their e8m0 scales, into bf16 [2, 128, 256]: 2 x (2 x 128 x 256) x 512 = 67,108,864 FLOPs, unit fp8."""
    text = program("  %a = f8e4m3fn[2,128,512]{2,1,0} parameter(0)\n  %b = f8e4m3fn[2,256,512]{2,1,0} parameter(1)\n"
                   "  %sa = f8e8m0fnu[2,128,16]{2,1,0} parameter(2)\n  %sb = f8e8m0fnu[2,256,16]{2,1,0} parameter(3)\n"
                   '  %bsd = bf16[2,128,256]{2,1,0} custom-call(%a, %b, %sa, %sb), custom_call_target="__cudnn$blockScaledDot"')
    k = kernels(text)["bsd"]
    assert (k.kind, k.unit, k.flops) == ("matmul", "fp8", 2 * (2 * 128 * 256) * 512)


def test_a_cudnn_convolution_counts_the_taps_that_meet_the_input():
    """A 3 x 3 SAME convolution of [2, 8, 8, 4] into 8 features (cuDNN, with a u8 workspace): per spatial
    dimension the border outputs meet 2 taps, the 6 inside 3: 2 x 2 + 6 x 3 = 22 pairs, 484 over both;
    2 x batch 2 x 8 out x 4 in x 484 = 61,952 FLOPs. Bytes: 1,024 + 576 read (bf16), 2,048 written."""
    text = program("  %x = bf16[2,8,8,4]{3,2,1,0} parameter(0)\n  %w = bf16[3,3,4,8]{3,2,1,0} parameter(1)\n"
                   "  %conv = (bf16[2,8,8,8]{3,2,1,0}, u8[65536]{0}) custom-call(%x, %w), window={size=3x3 pad=1_1x1_1}, "
                   'dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convForward"')
    k = kernels(text)["conv"]
    assert (k.kind, k.unit, k.flops) == ("convolution", "bf16", 2 * 2 * 8 * 4 * 484)
    assert k.bytes == 2 * (2 * 8 * 8 * 4) + 2 * (3 * 3 * 4 * 8) + 2 * (2 * 8 * 8 * 8)


@pytest.mark.parametrize("name, products", [("splash_mha_fwd", 2), ("splash_mha_dkv_no_residuals", 4),
                                            ("splash_mha_dq_no_residuals", 3)])
def test_splash_attention_on_a_tpu_counts_its_kernels_products_under_the_causal_mask(name, products):
    """Pallas splash attention of q [2, 4, 128, 64] (B, H, T, Dh), causal: a product is 2 x 65,536 x 128 / 2
    FLOPs; the forward kernel does 2, the dK/dV kernel 4 (it recomputes the scores), the dQ kernel 3."""
    text = program("  %q = bf16[2,4,128,64]{3,2,1,0} parameter(0)\n  %k = bf16[2,4,128,64]{3,2,1,0} parameter(1)\n"
                   f'  %{name} = bf16[2,4,128,64]{{3,2,1,0}} custom-call(%q, %k), custom_call_target="tpu_custom_call"')
    k = kernels(text)[name]
    assert (k.kind, k.flops) == ("attention", 2.0 * products * (2 * 4 * 128 * 64) * 128 / 2)


GROUPED_PROGRAM = """HloModule step

%select_fusion (kernel: bf16[512,256], activations: bf16[512,64], output_mask: pred[8,512]) -> bf16[8,64,256] {
  %activations = bf16[512,64]{1,0} parameter(1)
  %output_mask = pred[8,512]{1,0} parameter(2)
  %a = bf16[8,512,64]{2,1,0} broadcast(%activations), dimensions={1,2}
  %kernel = bf16[512,256]{1,0} parameter(0)
  %k = bf16[8,512,256]{2,1,0} broadcast(%kernel), dimensions={1,2}
  ROOT %conv = bf16[8,64,256]{2,1,0} convolution(%a, %k), window={size=8 stride=7 lhs_dilate=8}, dim_labels=0fb_0io->0bf
}

ENTRY %main (x: bf16[512,64], w: bf16[8,64,256], sizes: s32[8], dy: bf16[512,256], mask: pred[8,512]) -> f32[] {
  %x = bf16[512,64]{1,0} parameter(0)
  %w = bf16[8,64,256]{2,1,0} parameter(1)
  %sizes = s32[8]{0} parameter(2)
  %dy = bf16[512,256]{1,0} parameter(3)
  %mask = pred[8,512]{1,0} parameter(4)
  %ragged-dot-none = bf16[512,256]{1,0} custom-call(%sizes, %x, %w), custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/shard_map/ragged_dot_general/ragged-dot-none"}
  %ragged-dot-metadata = s32[8]{0} custom-call(%sizes), custom_call_target="tpu_custom_call", metadata={op_name="ragged-dot-metadata"}
  %grad = bf16[8,64,256]{2,1,0} fusion(%dy, %x, %mask), kind=kOutput, calls=%select_fusion
  ROOT %r = f32[] constant(0)
}
"""


def test_a_tpu_grouped_product_counts_each_row_once_forward_and_for_the_weights_gradient():
    """A dropless MoE layer's `ragged_dot` as libtpu compiles it (cut from a v5p compile of the tiny MoE):
    forward, its Mosaic kernel multiplies rows [512, 64] by 8 groups' [64, 256] weights, each row by its own
    group's: 2 x 512 x 256 x 64 = 16,777,216 FLOPs. The weights' gradient is one convolution over both inputs
    masked per group (pred [8, 512]) into [8, 64, 256]: its shape is 8 x that, its work a grouped GEMM's,
    16,777,216 too."""
    text = GROUPED_PROGRAM
    k = kernels(text)
    assert (k["ragged-dot-none"].kind, k["ragged-dot-none"].flops) == ("matmul", 2 * 512 * 256 * 64)
    assert (k["ragged-dot-metadata"].kind, k["ragged-dot-metadata"].flops) == ("memory", 0.0)
    assert (k["grad"].kind, k["grad"].flops) == ("convolution", 2 * 512 * 256 * 64)


def test_another_tpu_kernel_or_custom_call_is_memory_traffic_only():
    text = program("  %q = bf16[2,4,128,64]{3,2,1,0} parameter(0)\n"
                   '  %other = bf16[2,4,128,64]{3,2,1,0} custom-call(%q), custom_call_target="tpu_custom_call"\n'
                   '  %bits = u8[1024]{0} custom-call(%q), custom_call_target="my_rng"')
    k = kernels(text)
    assert (k["other"].kind, k["other"].flops, k["other"].unit) == ("memory", 0.0, None)
    # one result of bytes is the call's output, not a workspace: 131,072 read + 1,024 written
    assert (k["bits"].kind, k["bits"].bytes) == ("memory", 2 * 65536 + 1024)


def test_an_attention_call_it_cannot_read_counts_no_products():
    """No backend config, no score shape, or no operands: nothing to count from, 0 FLOPs (not a guess)."""
    q = "  %q = bf16[2,64,4,16]{3,2,1,0} parameter(0)\n"
    bare = program(q + '  %a = (bf16[2,4,64,16]{3,1,2,0}, u8[0]{0}) custom-call(%q), custom_call_target="__cudnn$fmhaSoftmax"')
    no_shape = program(q + '  %a = (bf16[2,4,64,16]{3,1,2,0}, u8[0]{0}) custom-call(%q), '
                           'custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{}}')
    no_operands = program('  %a = (bf16[2,4,64,16]{3,1,2,0}, u8[0]{0}) custom-call(), '
                          'custom_call_target="__cudnn$fmhaSoftmax", ' + FMHA_CONFIG.format(mask="NO_MASK"))
    for text in (bare, no_shape, no_operands):
        k = kernels(text)["a"]
        assert k.kind == "attention" and k.flops == 0.0


def test_a_decode_steps_attention_counts_the_keys_not_the_one_query():
    """One new token per sequence attends to 64 cached positions: scores [2, 4, 1, 64]; q [2, 1, 4, 16] is
    128 elements: 4 x 128 x 64 = 32,768 FLOPs (the key length, not the query length 1)."""
    config = FMHA_CONFIG.format(mask="NO_MASK").replace('["2", "4", "64", "64"]', '["2", "4", "1", "64"]')
    text = program("  %q = bf16[2,1,4,16]{3,2,1,0} parameter(0)\n  %k = bf16[2,64,2,16]{3,2,1,0} parameter(1)\n"
                   '  %a = (bf16[2,4,1,16]{3,1,2,0}, u8[0]{0}) custom-call(%q, %k), '
                   f'custom_call_target="__cudnn$fmhaSoftmax", {config}')
    assert kernels(text)["a"].flops == 4 * 128 * 64


# -- products without contraction, mixed operand types ---------------------------------------------------------

def test_a_dot_without_contracting_dimensions_is_a_batched_outer_product():
    """[4, 64] x [4, 32] with batch dimension 0 only: [4, 64, 32], 2 x 4 x 64 x 32 x 1 = 16,384 FLOPs."""
    text = program("  %a = bf16[4,64]{1,0} parameter(0)\n  %b = bf16[4,32]{1,0} parameter(1)\n"
                   "  %dot = bf16[4,64,32]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, rhs_batch_dims={0}")
    assert kernels(text)["dot"].flops == 2 * 4 * 64 * 32


def test_a_dot_contracting_two_dimensions_multiplies_both():
    """lhs [16, 8, 32] contracting {1, 2} (256) with rhs [8, 32, 64]: 2 x 16 x 64 x 256 = 524,288."""
    text = program("  %a = bf16[16,8,32]{2,1,0} parameter(0)\n  %b = bf16[8,32,64]{2,1,0} parameter(1)\n"
                   "  %dot = bf16[16,64]{1,0} dot(%a, %b), lhs_contracting_dims={1,2}, rhs_contracting_dims={0,1}")
    assert kernels(text)["dot"].flops == 2 * 16 * 64 * 256


def test_a_mixed_product_runs_in_its_left_operands_unit():
    """bf16 x f32 (an fp32 master weight read into a bf16 product): the unit is the lhs's, bf16, not TF32."""
    text = program("  %a = bf16[64,64]{1,0} parameter(0)\n  %b = f32[64,64]{1,0} parameter(1)\n"
                   "  %dot = f32[64,64]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}")
    assert kernels(text)["dot"].unit == "bf16"


# -- collectives: combined, on-chip memory, groups in every printed form ----------------------------------------

def test_a_combined_all_gather_moves_every_result():
    """XLA's combiner gathers two parameters in one call: results [8192] bf16 and [8192] f32 = 16,384 +
    32,768 B, both sent round the ring (not only the second)."""
    text = program("  %a = bf16[1024]{0} parameter(0)\n  %b = f32[1024]{0} parameter(1)\n"
                   "  %ag = (bf16[8192]{0}, f32[8192]{0}) all-gather(%a, %b), replica_groups=[1,8]<=[8], dimensions={0}")
    k = kernels(text)["ag"]
    assert (k.bytes, k.group, k.asynchronous) == (16384 + 32768, 8, False)


def test_a_collective_of_arrays_held_on_chip_still_moves_them_over_the_links():
    """A TPU array in vector memory (S(1)) costs no HBM traffic, but a collective sends it: all-reduce of
    [1024] f32 in S(1) moves 4,096 B; an all-gather into S(1) its 8 x 4,096 B result."""
    text = program("  %a = f32[1024]{0:S(1)} parameter(0)\n"
                   "  %ar = f32[1024]{0:S(1)} all-reduce(%a), replica_groups={{0,1,2,3}}, to_apply=%add\n"
                   "  %ag = f32[8192]{0:S(1)} all-gather(%a), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}")
    k = kernels(text)
    assert k["ar"].bytes == 4096 and k["ag"].bytes == 8 * 4096


def test_a_collective_without_groups_is_a_group_of_one():
    text = program("  %a = f32[1024]{0} parameter(0)\n  %ar = f32[1024]{0} all-reduce(%a), to_apply=%add")
    k = kernels(text, per_node=8)["ar"]
    assert (k.group, k.nodes) == (1, 1)


@pytest.mark.parametrize("attrs, group", [
    ("replica_groups=mesh['a'=4,'b'=8] {'b'}", [0, 1, 2, 3, 4, 5, 6, 7]),  # row-major: b is the inner axis
    ("replica_groups=mesh['a'=4,'b'=8] {'a'}", [0, 8, 16, 24]),
    ("replica_groups=mesh['x'=2,'y'=2,'z'=4] {'x','z'}", [0, 1, 2, 3, 8, 9, 10, 11]),  # strides z 1, y 4, x 8
    ("replica_groups=[2,4]<=[8]", [0, 1, 2, 3]),
    ("replica_groups=[2,4]<=[2,4]T(1,0)", [0, 4, 1, 5]),  # the iota transposed: columns first
    ("replica_groups=[4,2]<=[2,2,2]T(2,1,0)", [0, 4]),
    ("replica_groups={{3,5,7}}", [3, 5, 7]),
    ("source_target_pairs={{0,1},{1,2}}", [0, 1]),
    ("dimensions={0}", []),
])
def test_the_first_replica_group_in_each_form_xla_prints(attrs, group):
    from migration.planning.hlo_collectives import first_group, group_size

    assert first_group(attrs) == group
    assert group_size(attrs) == (2 if "pairs" in attrs else len(group) or 1)


# -- the compile cache's rows -------------------------------------------------------------------------------

def test_kernels_survive_the_caches_rows_and_alike_ones_merge():
    """Two launches of one fusion (each 1e6 FLOPs, 4,096 B) and an asynchronous all-gather over 16 devices on
    2 nodes pack into two rows; unpacked, every figure is back: the fusion's 2 launches with their total
    FLOPs and bytes, the collective's group, asynchrony and nodes."""
    from migration.planning.hlo_cost import Kernel, pack, unpack

    kernels_in = [Kernel("f.1", "matmul", 1e6, 4096.0, "bf16", 1.0),
                  Kernel("f.2", "matmul", 1e6, 4096.0, "bf16", 1.0),
                  Kernel("ag", "all-gather", 0.0, 8192.0, None, 3.0, group=16, asynchronous=True, nodes=2)]
    rows = pack(kernels_in)
    assert rows == [["matmul", 1000000, 4096, "bf16", 2.0, 1, False, 1], ["all-gather", 0, 2731, None, 3.0, 16, True, 2]]
    out = unpack(rows)
    assert [(k.name, k.kind, k.flops, k.bytes, k.unit, k.count, k.group, k.asynchronous, k.nodes) for k in out] == [
        ("matmul#0", "matmul", 2e6, 8192, "bf16", 2.0, 1, False, 1),
        ("all-gather#1", "all-gather", 0, 2731 * 3.0, None, 3.0, 16, True, 2)]


def test_rows_cached_before_nodes_were_counted_read_as_one_node_and_a_kernel_never_run_packs():
    from migration.planning.hlo_cost import Kernel, pack, unpack

    assert unpack([["all-reduce", 0, 100, None, 1.0, 8, False]])[0].nodes == 1
    # a kernel in a branch never taken (count 0) packs without dividing by zero, and adds nothing
    rows = pack([Kernel("never", "memory", 0.0, 0.0, None, 0.0)])
    assert rows == [["memory", 0, 0, None, 0.0, 1, False, 1]]
    # half a launch per step (a kernel of a loop that runs every other step): per launch, twice its share
    assert pack([Kernel("half", "memory", 1e6, 500.0, None, 0.5)]) == [["memory", 2000000, 1000, None, 0.5, 1, False, 1]]


# -- loops, calls, branches: how often each kernel runs --------------------------------------------------------

DOT = "dot({x}, {x}), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}"
PRODUCT = 2 * 64 * 64 * 64  # one [64, 64] x [64, 64] product


def loop_program(direction: str = "LT", start: str = "constant(3)", bound: str = "constant(10)", index: int = 0,
                 config: str = "", step: int = 1, copied: bool = False) -> str:
    """A loop whose body runs one product, its counter at tuple `index`, `counter <direction> bound` (a TPU
    program writes no trip count: its condition says it); `copied`: the body adds its step to a copy of the
    counter (libtpu writes the windowed einsum loops of some layouts so)."""
    counter, value = (0, 1) if index == 0 else (1, 0)
    types = "(s32[], bf16[64,64]{1,0})" if index == 0 else "(bf16[64,64]{1,0}, s32[])"
    init = "%start, %x" if index == 0 else "%x, %start"
    out = "%next, %dot" if index == 0 else "%dot, %next"
    return f"""HloModule step

%body (p: {types}) -> {types} {{
  %p = {types} parameter(0)
  %i = s32[] get-tuple-element(%p), index={counter}
  %x = bf16[64,64]{{1,0}} get-tuple-element(%p), index={value}
  %dot = bf16[64,64]{{1,0}} {DOT.format(x="%x")}
  %one = s32[] constant({step})
  %held = s32[] copy(%i)
  %next = s32[] add({"%held" if copied else "%i"}, %one)
  ROOT %t = {types} tuple({out})
}}

%cond (p: {types}) -> pred[] {{
  %p = {types} parameter(0)
  %i = s32[] get-tuple-element(%p), index={counter}
  %n = s32[] {bound}
  ROOT %c = pred[] compare(%i, %n), direction={direction}
}}

ENTRY %main (x: bf16[64,64], s: s32[]) -> {types} {{
  %x = bf16[64,64]{{1,0}} parameter(0)
  %s = s32[] parameter(1)
  %three = s32[] constant(3)
  %start = s32[] {start}
  %init = {types} tuple({init})
  ROOT %loop = {types} while(%init), condition=%cond, body=%body{config}
}}
"""


@pytest.mark.parametrize("direction, start, bound, index, trips", [
    ("LT", "constant(3)", "constant(10)", 0, 7),  # 3, 4, ..., 9
    ("LE", "constant(3)", "constant(10)", 0, 8),  # ... 10
    ("NE", "constant(3)", "constant(10)", 0, 7),
    ("LT", "constant(3)", "constant(10)", 1, 7),  # the counter second in the tuple
    ("LT", "add(%s, %s)", "constant(10)", 0, 10),  # a start that is not a constant: read as 0
    ("GT", "constant(3)", "constant(10)", 0, 1),  # a condition of another form: once
    ("LT", "constant(3)", "add(%i, %i)", 0, 1),  # a bound that is not a constant: once
    ("LT", "constant(12)", "constant(10)", 0, 1),  # already past the bound: at least once
])
def test_a_tpu_loop_runs_as_often_as_its_condition_says(direction, start, bound, index, trips):
    k = kernels(loop_program(direction, start, bound, index))
    assert k["dot"].count == trips and k["dot"].flops == trips * PRODUCT
    assert k["next"].count == trips and k["dot"].bytes == trips * 3 * 8192  # two operands read, one written


@pytest.mark.parametrize("start, bound, step, trips", [
    ("constant(0)", "constant(8)", 2, 4),  # XLA's windowed einsum loop: two chunks a trip
    ("constant(3)", "constant(10)", 3, 3),  # 3, 6, 9
    ("copy(%three)", "constant(10)", 1, 7),  # a start copied from a constant
    ("copy(%three)", "constant(10)", 2, 4),  # 3, 5, 7, 9
])
def test_a_tpu_loop_counting_by_more_than_one_runs_fewer_trips(start, bound, step, trips):
    k = kernels(loop_program("LT", start, bound, step=step))
    assert k["dot"].count == trips and k["dot"].flops == trips * PRODUCT


@pytest.mark.parametrize("step, trips", [(2, 4), (1, 8), (3, 3)])
def test_a_tpu_loop_adding_its_step_to_a_copy_of_its_counter_runs_the_same_trips(step, trips):
    """libtpu's collective-matmul loop in MaxText's 256B model on one v5p-1024 slice (fsdp 64 x tensor 8) adds 2
    to a copy of its counter (`add(copy(gte), 2)`, `counter < 4`); on two slices the same loop adds 2 to the
    counter itself. Both run 2 trips: read without the copy, the one-slice step counted every collective matmul
    twice (9,267 against 6,452 TFLOP a device for the same per-chip work)."""
    k = kernels(loop_program("LT", "constant(0)", "constant(8)", step=step, copied=True))
    assert k["dot"].count == trips and k["dot"].flops == trips * PRODUCT
    assert k["dot"].count == kernels(loop_program("LT", "constant(0)", "constant(8)", step=step))["dot"].count


def test_an_async_collective_fusion_is_a_kernel_and_a_collective_beside_it():
    """libtpu fuses a collective with the product it overlaps (an async collective fusion): the product's
    kernel reads its operands and writes its result; the gather is an asynchronous collective of its own; the
    buffers the fusion hands back untouched move nowhere."""
    text = """HloModule step

%acf (a: bf16[64,64], w: bf16[64,64], shard: bf16[8,64], carried: bf16[1024,64]) -> (bf16[64,64], bf16[64,64], bf16[64,64], bf16[1024,64]) {
  %a = bf16[64,64]{1,0} parameter(0)
  %w = bf16[64,64]{1,0} parameter(1)
  %shard = bf16[8,64]{1,0} parameter(2)
  %carried = bf16[1024,64]{1,0} parameter(3)
  %product = bf16[64,64]{1,0} dot(%a, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %gathered = bf16[64,64]{1,0} all-gather(%shard), replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %t = (bf16[64,64]{1,0}, bf16[64,64]{1,0}, bf16[64,64]{1,0}, bf16[1024,64]{1,0}) tuple(%product, %gathered, %w, %carried)
}

ENTRY %main (a: bf16[64,64], w: bf16[64,64], shard: bf16[8,64], carried: bf16[1024,64]) -> (bf16[64,64], bf16[64,64], bf16[64,64], bf16[1024,64]) {
  %a = bf16[64,64]{1,0} parameter(0)
  %w = bf16[64,64]{1,0} parameter(1)
  %shard = bf16[8,64]{1,0} parameter(2)
  %carried = bf16[1024,64]{1,0} parameter(3)
  ROOT %f = (bf16[64,64]{1,0}, bf16[64,64]{1,0}, bf16[64,64]{1,0}, bf16[1024,64]{1,0}) fusion(%a, %w, %shard, %carried), kind=kOutput, calls=%acf
}
"""
    k = kernels(text)
    assert k["f"].flops == PRODUCT and k["f"].bytes == 3 * 8192  # a and w read, the product written
    gather = k["gathered"]
    assert gather.kind == "all-gather" and gather.asynchronous and gather.group == 8 and gather.bytes == 8192


def test_a_scanned_stack_seen_through_a_relayout_is_still_sliced_and_updated_in_place():
    """libtpu retiles a layer scan's stacked buffer inside the fusion that reads or writes one layer of it (a
    nested fusion of the buffer alone, same dimensions): reading a layer costs the layer, writing one the
    update, not the 80-layer stack."""
    text = """HloModule step

%retile (a: bf16[80,64,64]) -> bf16[80,64,64] {
  %a = bf16[80,64,64]{2,1,0} parameter(0)
  ROOT %c = bf16[80,64,64]{2,1,0:T(8,128)} copy(%a)
}

%read_one (stack: bf16[80,64,64], i: s32[]) -> bf16[1,64,64] {
  %stack = bf16[80,64,64]{2,1,0:T(16,128)} parameter(0)
  %i = s32[] parameter(1)
  %view = bf16[80,64,64]{2,1,0:T(8,128)} fusion(%stack), kind=kLoop, calls=%retile
  %zero = s32[] constant(0)
  %layer = bf16[1,64,64]{2,1,0} dynamic-slice(%view, %i, %zero, %zero), dynamic_slice_sizes={1,64,64}
  ROOT %out = bf16[1,64,64]{2,1,0:T(16,128)} copy(%layer)
}

%write_one (stack: bf16[80,64,64], i: s32[], update: bf16[1,64,64]) -> bf16[80,64,64] {
  %stack = bf16[80,64,64]{2,1,0:T(16,128)} parameter(0)
  %i = s32[] parameter(1)
  %update = bf16[1,64,64]{2,1,0} parameter(2)
  %view = bf16[80,64,64]{2,1,0:T(8,128)} fusion(%stack), kind=kLoop, calls=%retile
  %zero = s32[] constant(0)
  ROOT %dus = bf16[80,64,64]{2,1,0:T(16,128)} dynamic-update-slice(%view, %update, %i, %zero, %zero)
}

ENTRY %main (stack: bf16[80,64,64], i: s32[], update: bf16[1,64,64]) -> (bf16[1,64,64], bf16[80,64,64]) {
  %stack = bf16[80,64,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %update = bf16[1,64,64]{2,1,0} parameter(2)
  %r = bf16[1,64,64]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%read_one
  %w = bf16[80,64,64]{2,1,0} fusion(%stack, %i, %update), kind=kLoop, calls=%write_one
  ROOT %t = (bf16[1,64,64]{2,1,0}, bf16[80,64,64]{2,1,0}) tuple(%r, %w)
}
"""
    k = kernels(text)
    layer = 64 * 64 * 2
    assert k["r"].bytes == layer + 4 + layer  # the layer read (and its index), the layer written
    assert k["w"].bytes == 4 + layer + layer  # the index and update read, the update written in place


def test_the_start_and_end_of_a_tpu_async_collective_move_nothing_but_the_collective():
    """libtpu's async-collective-start / -done fusions bracket a collective (AsyncCollectiveStart/Done
    custom-calls): the gather is the traffic, counted once as an asynchronous collective."""
    text = """HloModule step

%start_body (a: bf16[8,64]) -> (bf16[8,64], bf16[64,64]) {
  %a = bf16[8,64]{1,0} parameter(0)
  ROOT %s = (bf16[8,64]{1,0}, bf16[64,64]{1,0}) custom-call(%a), custom_call_target="AsyncCollectiveStart"
}

%done_body (a: bf16[8,64], buffer: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[8,64]{1,0} parameter(0)
  %buffer = bf16[64,64]{1,0} parameter(1)
  %gathered = bf16[64,64]{1,0} all-gather(%a), replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %d = bf16[64,64]{1,0} custom-call(%a, %buffer, %gathered), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (a: bf16[8,64]) -> bf16[64,64] {
  %a = bf16[8,64]{1,0} parameter(0)
  %start = (bf16[8,64]{1,0}, bf16[64,64]{1,0}) fusion(%a), kind=kCustom, calls=%start_body
  %x = bf16[8,64]{1,0} get-tuple-element(%start), index=0
  %buf = bf16[64,64]{1,0} get-tuple-element(%start), index=1
  ROOT %done = bf16[64,64]{1,0} fusion(%x, %buf), kind=kCustom, calls=%done_body
}
"""
    k = kernels(text)
    assert k["start"].bytes == 0 and k["done"].bytes == 0
    assert k["gathered"].asynchronous and k["gathered"].bytes == 8192 and k["gathered"].group == 8


def test_a_windowed_einsums_permutes_overlap_its_products_and_other_permutes_do_not():
    """XLA's collective matmul (a loop body named windowed_dot_general_...) sends the next chunk while this
    chunk's product runs: its collective-permutes are asynchronous; the same permute in another loop is not."""
    def program(body: str) -> str:
        types = "(s32[], bf16[64,64]{1,0})"
        return f"""HloModule step

%{body} (p: {types}) -> {types} {{
  %p = {types} parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[64,64]{{1,0}} get-tuple-element(%p), index=1
  %dot = bf16[64,64]{{1,0}} {DOT.format(x="%x")}
  %permute = bf16[64,64]{{1,0}} collective-permute(%x), source_target_pairs={{{{0,1}},{{1,0}}}}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = {types} tuple(%next, %dot)
}}

%cond (p: {types}) -> pred[] {{
  %p = {types} parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %c = pred[] compare(%i, %n), direction=LT
}}

ENTRY %main (x: bf16[64,64]) -> {types} {{
  %x = bf16[64,64]{{1,0}} parameter(0)
  %zero = s32[] constant(0)
  %init = {types} tuple(%zero, %x)
  ROOT %loop = {types} while(%init), condition=%cond, body=%{body}
}}
"""
    windowed = kernels(program("windowed_dot_general_body_ag"))["permute"]
    other = kernels(program("region_0.5_spmd"))["permute"]
    assert windowed.asynchronous and not other.asynchronous
    assert windowed.count == other.count == 4 and windowed.bytes == other.bytes == 4 * 8192


def test_a_gpu_loop_states_its_trip_count():
    config = ', backend_config={"known_trip_count":{"n":"12"}}'
    assert kernels(loop_program("GT", config=config))["dot"].count == 12  # the stated count, not the condition's


NESTED_AND_CALLED = """HloModule step

%leaf (a: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  ROOT %inner_dot = bf16[64,64]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%applied (a: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  ROOT %applied_dot = bf16[64,64]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%offloaded (a: bf16[64,64]) -> bf16[512,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  ROOT %sc_gather = bf16[512,64]{1,0} all-gather(%a), replica_groups=[1,8]<=[8], dimensions={0}
}

%cheap (a: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  ROOT %cheap_neg = bf16[64,64]{1,0} negate(%a)
}

%costly (a: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  ROOT %costly_dot = bf16[64,64]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%self (a: bf16[64,64]) -> bf16[64,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %again = bf16[64,64]{1,0} call(%a), to_apply=%self
  ROOT %self_neg = bf16[64,64]{1,0} negate(%again)
}

ENTRY %main (x: bf16[64,64], b: pred[], k: s32[]) -> bf16[64,64] {
  %x = bf16[64,64]{1,0} parameter(0)
  %b = pred[] parameter(1)
  %k = s32[] parameter(2)
  %called = bf16[64,64]{1,0} call(%x), calls=%leaf
  %as = ((bf16[64,64]{1,0}), bf16[64,64]{1,0}, s32[]) async-start(%x), calls=%leaf
  %ad = bf16[64,64]{1,0} async-done(%as)
  %app = bf16[64,64]{1,0} call(%x), to_apply=%applied
  %cs = ((bf16[64,64]{1,0}), bf16[512,64]{1,0}) call-start(%x), async_execution_thread="sparsecore", to_apply=%offloaded
  %cd = bf16[512,64]{1,0} call-done(%cs)
  %two = bf16[64,64]{1,0} conditional(%b, %x, %x), true_computation=%cheap, false_computation=%costly
  %three = bf16[64,64]{1,0} conditional(%k, %x, %x, %x), branch_computations={%cheap, %costly, %cheap}
  %recursive = bf16[64,64]{1,0} call(%x), to_apply=%self
  %missing = bf16[64,64]{1,0} call(%x), calls=%nowhere
  ROOT %c = bf16[64,64]{1,0} copy(%x)
}
"""


def test_called_computations_are_inlined_and_a_branch_counts_its_costliest():
    """A call (calls= or to_apply=) and an async-start run their computation once; a computation started on
    another engine (call-start) runs asynchronously: its all-gather overlaps; a conditional counts its
    costliest branch, in both forms XLA prints; a computation calling itself is read once; a call to a
    computation the text does not have adds nothing."""
    ks = ProgramReader(NESTED_AND_CALLED).read()
    names = [k.name for k in ks]
    assert names.count("inner_dot") == 2 and names.count("applied_dot") == 1
    assert names.count("costly_dot") == 2 and "cheap_neg" not in names
    assert names.count("self_neg") == 1 and "again" not in names
    gather = next(k for k in ks if k.name == "sc_gather")
    assert gather.asynchronous and gather.group == 8 and gather.bytes == 512 * 64 * 2
    assert sum(k.flops for k in ks) == 5 * PRODUCT
    assert names == ["inner_dot", "inner_dot", "applied_dot", "sc_gather", "costly_dot", "costly_dot", "self_neg", "c"]


def test_kernels_inside_a_loop_inside_a_loop_run_the_product_of_the_trips():
    config = ', backend_config={"known_trip_count":{"n":"4"}}'
    inner = loop_program(config=config).replace("ENTRY %main", "%inner_main").replace("%body", "%ibody").replace(
        "%cond", "%icond").replace("HloModule step\n", "")
    text = ("HloModule step\n" + inner.replace("ROOT %loop", "ROOT %iloop") + """
%obody (p: (s32[], bf16[64,64])) -> (s32[], bf16[64,64]) {
  %p = (s32[], bf16[64,64]{1,0}) parameter(0)
  %x = bf16[64,64]{1,0} get-tuple-element(%p), index=1
  %s = s32[] get-tuple-element(%p), index=0
  ROOT %r = (s32[], bf16[64,64]{1,0}) call(%x, %s), to_apply=%inner_main
}

%ocond (p: (s32[], bf16[64,64])) -> pred[] {
  %p = (s32[], bf16[64,64]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: bf16[64,64]) -> (s32[], bf16[64,64]) {
  %x = bf16[64,64]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], bf16[64,64]{1,0}) tuple(%z, %x)
  ROOT %outer = (s32[], bf16[64,64]{1,0}) while(%init), condition=%ocond, body=%obody, backend_config={"known_trip_count":{"n":"3"}}
}
""")
    k = kernels(text)
    assert k["dot"].count == 12 and k["dot"].flops == 12 * PRODUCT


def test_a_top_level_convolution_counts_like_a_fused_one():
    """The [2, 8, 8, 4] x [3, 3, 4, 8] SAME convolution written as an instruction of its own (no fusion,
    no library call): 61,952 FLOPs as above, kind convolution, the unit of its bf16 result."""
    text = program("  %x = bf16[2,8,8,4]{3,2,1,0} parameter(0)\n  %w = bf16[3,3,4,8]{3,2,1,0} parameter(1)\n"
                   "  %conv = bf16[2,8,8,8]{3,2,1,0} convolution(%x, %w), window={size=3x3 pad=1_1x1_1}, "
                   "dim_labels=b01f_01io->b01f")
    k = kernels(text)["conv"]
    assert (k.kind, k.unit, k.flops) == ("convolution", "bf16", 2 * 2 * 8 * 4 * 484)


def test_a_strided_dilated_convolution_counts_only_the_taps_on_input_elements():
    """One dimension of 4 inputs dilated by 2 (positions 0, 2, 4, 6 hold elements), a 3-tap kernel,
    stride 1, padding 1 each side, 7 outputs: output o's tap k reads position o + k - 1; pairs that land on
    an element: o=0: k=1; o=1: k=0, 2; o=2: k=1; o=3: k=0, 2; o=4: k=1; o=5: k=0, 2; o=6: k=1 = 10.
    2 x 1 x 1 x 1 x 10 = 20 FLOPs."""
    from migration.planning.hlo_cost import _valid_pairs

    assert _valid_pairs(in_size=4, out_size=7, size=3, stride=1, pad_low=1, lhs_dilate=2, rhs_dilate=1) == 10
    # stride 2 over the same: outputs 0..3 read positions 2o + k - 1: o=0: k=1; o=1: k=1; o=2: k=1; o=3: k=1
    assert _valid_pairs(in_size=4, out_size=4, size=3, stride=2, pad_low=1, lhs_dilate=2, rhs_dilate=1) == 4
    # kernel dilated by 2 over 5 plain inputs, no padding: outputs 0..0 (5 - 4), taps at 0, 2, 4: 3 pairs
    assert _valid_pairs(in_size=5, out_size=1, size=3, stride=1, pad_low=0, lhs_dilate=1, rhs_dilate=2) == 3
    text = program("  %x = f32[1,4,1]{2,1,0} parameter(0)\n  %w = f32[3,1,1]{2,1,0} parameter(1)\n"
                   "  %conv = f32[1,7,1]{2,1,0} convolution(%x, %w), window={size=3 pad=1_1 lhs_dilate=2}, "
                   "dim_labels=b0f_0io->b0f")
    assert kernels(text)["conv"].flops == 2 * 10


def test_asynchronous_copies_scatters_and_updates_move_what_they_move():
    """A TPU prefetch (copy-start, dynamic-slice-start) moves its result once; an update in place, started
    asynchronously (an activation offloaded to the host), reads and writes the update; a scatter into a
    buffer reads its indices and updates and writes the updates."""
    text = program(
        "  %w = bf16[1024]{0} parameter(0)\n  %stack = bf16[8,1024]{1,0} parameter(1)\n  %i = s32[] parameter(2)\n"
        "  %idx = s32[16,1]{1,0} parameter(3)\n  %upd = bf16[16,1024]{1,0} parameter(4)\n"
        "  %big = bf16[4096,1024]{1,0} parameter(5)\n"
        "  %cs = (bf16[1024]{0}, bf16[1024]{0:S(1)}, u32[]) copy-start(%w)\n"
        "  %dss = ((bf16[8,1024]{1,0}, s32[], s32[]), bf16[1,1024]{1,0:S(1)}, u32[]) dynamic-slice-start(%stack, %i, %i)\n"
        "  %row = bf16[1,1024]{1,0} parameter(6)\n"
        "  %dus = ((bf16[8,1024]{1,0}, bf16[1,1024]{1,0}, s32[], s32[]), bf16[8,1024]{1,0:S(5)}, u32[]) "
        "dynamic-update-slice-start(%stack, %row, %i, %i)\n"
        "  %sc = bf16[4096,1024]{1,0} scatter(%big, %idx, %upd), update_window_dims={1}, inserted_window_dims={0}, "
        "scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add")
    k = kernels(text)
    assert k["cs"].bytes == 2048 and k["dss"].bytes == 2048
    assert k["dus"].bytes == 2 * 2048
    assert k["sc"].bytes == 16 * 4 + 2 * (16 * 1024 * 2)


UPDATES = """HloModule step

%two_updates (p0: bf16[8,1024], p1: bf16[1,1024], p2: bf16[8,512], p3: bf16[1,512], p4: s32[]) -> (bf16[8,1024], bf16[8,512]) {
  %p0 = bf16[8,1024]{1,0} parameter(0)
  %p1 = bf16[1,1024]{1,0} parameter(1)
  %p2 = bf16[8,512]{1,0} parameter(2)
  %p3 = bf16[1,512]{1,0} parameter(3)
  %p4 = s32[] parameter(4)
  %z = s32[] constant(0)
  %u0 = bf16[8,1024]{1,0} dynamic-update-slice(%p0, %p1, %p4, %z)
  %u1 = bf16[8,512]{1,0} dynamic-update-slice(%p2, %p3, %p4, %z)
  ROOT %t = (bf16[8,1024]{1,0}, bf16[8,512]{1,0}) tuple(%u0, %u1)
}

%reshaped (p0: bf16[8,1024], p1: bf16[1,1024], p2: s32[]) -> bf16[8192] {
  %p0 = bf16[8,1024]{1,0} parameter(0)
  %p1 = bf16[1,1024]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %u = bf16[8,1024]{1,0} dynamic-update-slice(%p0, %p1, %p2, %z)
  ROOT %b = bf16[8192]{0} bitcast(%u)
}

%scatter_then_update (p0: s32[16,1], p1: bf16[16,1024], p2: bf16[8,512], p3: bf16[1,512], p4: s32[]) -> (bf16[4096,1024], bf16[8,512]) {
  %p0 = s32[16,1]{1,0} parameter(0)
  %p1 = bf16[16,1024]{1,0} parameter(1)
  %p2 = bf16[8,512]{1,0} parameter(2)
  %p3 = bf16[1,512]{1,0} parameter(3)
  %p4 = s32[] parameter(4)
  %zero = bf16[] constant(0)
  %z = s32[] constant(0)
  %buf = bf16[4096,1024]{1,0} broadcast(%zero), dimensions={}
  %sc = bf16[4096,1024]{1,0} scatter(%buf, %p0, %p1), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
  %u = bf16[8,512]{1,0} dynamic-update-slice(%p2, %p3, %p4, %z)
  ROOT %t = (bf16[4096,1024]{1,0}, bf16[8,512]{1,0}) tuple(%sc, %u)
}

ENTRY %main (a: bf16[8,1024], b: bf16[1,1024], c: bf16[8,512], d: bf16[1,512], i: s32[], idx: s32[16,1], upd: bf16[16,1024]) -> f32[] {
  %a = bf16[8,1024]{1,0} parameter(0)
  %b = bf16[1,1024]{1,0} parameter(1)
  %c = bf16[8,512]{1,0} parameter(2)
  %d = bf16[1,512]{1,0} parameter(3)
  %i = s32[] parameter(4)
  %idx = s32[16,1]{1,0} parameter(5)
  %upd = bf16[16,1024]{1,0} parameter(6)
  %both = (bf16[8,1024]{1,0}, bf16[8,512]{1,0}) fusion(%a, %b, %c, %d, %i), kind=kLoop, calls=%two_updates
  %flat = bf16[8192]{0} fusion(%a, %b, %i), kind=kLoop, calls=%reshaped
  %mixed = (bf16[4096,1024]{1,0}, bf16[8,512]{1,0}) fusion(%idx, %upd, %c, %d, %i), kind=kLoop, calls=%scatter_then_update
  ROOT %r = f32[] constant(0)
}
"""


def test_a_fusion_of_several_updates_in_place_writes_each_update():
    """Two rows updated in place, returned as a tuple: rows of 1,024 and 512 bf16 (2,048 + 1,024 B) read and
    written, the index (4 B) read, the two buffers (16 KiB and 8 KiB) neither: 3,076 + 3,072 = 6,148 B. The
    same update returned through a bitcast: 2,048 + 4 read, 2,048 written = 4,100 B. A scatter into a buffer
    the fusion makes (a broadcast of zeros, 4,096 x 1,024 x 2 B = 8 MiB) writes it whole and reads its 16
    indices (64 B) and 16 rows (32,768 B); the row update after it still counts: 8,388,608 + 1,024 written,
    64 + 32,768 + 1,024 + 4 read = 8,423,492 B."""
    k = kernels(UPDATES)
    assert k["both"].bytes == 6_148
    assert k["flat"].bytes == 4_100
    assert k["mixed"].bytes == 8_388_608 + 1_024 + 64 + 32_768 + 1_024 + 4


def test_convolutions_inside_a_fusion_are_counted_each():
    """Two [2, 8, 8, 4] x [3, 3, 4, 8] SAME convolutions fused with their sum: 61,952 FLOPs each (as the
    top-level one above), 123,904 in all, kind convolution, the unit of the bf16 input."""
    text = """HloModule step

%fused_convs (p0: bf16[2,8,8,4], p1: bf16[3,3,4,8]) -> bf16[2,8,8,8] {
  %p0 = bf16[2,8,8,4]{3,2,1,0} parameter(0)
  %p1 = bf16[3,3,4,8]{3,2,1,0} parameter(1)
  %c1 = bf16[2,8,8,8]{3,2,1,0} convolution(%p0, %p1), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
  %c2 = bf16[2,8,8,8]{3,2,1,0} convolution(%p0, %p1), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
  ROOT %s = bf16[2,8,8,8]{3,2,1,0} add(%c1, %c2)
}

ENTRY %main (x: bf16[2,8,8,4], w: bf16[3,3,4,8]) -> bf16[2,8,8,8] {
  %x = bf16[2,8,8,4]{3,2,1,0} parameter(0)
  %w = bf16[3,3,4,8]{3,2,1,0} parameter(1)
  ROOT %f = bf16[2,8,8,8]{3,2,1,0} fusion(%x, %w), kind=kOutput, calls=%fused_convs
}
"""
    k = kernels(text)["f"]
    assert (k.kind, k.unit, k.flops) == ("convolution", "bf16", 2 * 61_952)


def test_a_collective_in_a_branch_spans_the_nodes_its_group_does():
    """A conditional whose costlier branch all-reduces over 16 devices: with 8 a node, the collective crosses
    2 nodes there as it would outside a branch (the other branch only negates)."""
    text = """HloModule step

%b0 (p: bf16[1024]) -> bf16[1024] {
  %p = bf16[1024]{0} parameter(0)
  %n = bf16[1024]{0} negate(%p)
  ROOT %ar = bf16[1024]{0} all-reduce(%n), replica_groups=[1,16]<=[16], to_apply=%add
}

%b1 (p: bf16[1024]) -> bf16[1024] {
  %p = bf16[1024]{0} parameter(0)
  ROOT %m = bf16[1024]{0} negate(%p)
}

ENTRY %main (i: s32[], x: bf16[1024]) -> bf16[1024] {
  %i = s32[] parameter(0)
  %x = bf16[1024]{0} parameter(1)
  ROOT %c = bf16[1024]{0} conditional(%i, %x, %x), branch_computations={%b0, %b1}
}
"""
    k = kernels(text, per_node=8)
    assert "m" not in k and (k["ar"].group, k["ar"].nodes) == (16, 2)
    assert kernels(text, per_node=16)["ar"].nodes == 1


def test_collectives_nested_in_an_offloaded_computation_stay_asynchronous():
    """A computation started on another engine (call-start) that gathers inside a loop of 2 trips, inside a
    fusion's called computation and inside a plain call: every one of those gathers overlaps the main
    program's work, as the offloaded computation's own would."""
    text = """HloModule step

%g_body (p: (s32[], bf16[64,64])) -> (s32[], bf16[64,64]) {
  %p = (s32[], bf16[64,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[64,64]{1,0} get-tuple-element(%p), index=1
  %loop_gather = bf16[512,64]{1,0} all-gather(%x), replica_groups=[1,8]<=[8], dimensions={0}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[64,64]{1,0}) tuple(%next, %x)
}

%g_cond (p: (s32[], bf16[64,64])) -> pred[] {
  %p = (s32[], bf16[64,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(2)
  ROOT %c = pred[] compare(%i, %n), direction=LT
}

%called (a: bf16[64,64]) -> bf16[512,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  ROOT %call_gather = bf16[512,64]{1,0} all-gather(%a), replica_groups=[1,8]<=[8], dimensions={0}
}

%applied (a: bf16[64,64]) -> bf16[512,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  ROOT %apply_gather = bf16[512,64]{1,0} all-gather(%a), replica_groups=[1,8]<=[8], dimensions={0}
}

%offloaded (a: bf16[64,64]) -> bf16[512,64] {
  %a = bf16[64,64]{1,0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], bf16[64,64]{1,0}) tuple(%z, %a)
  %w = (s32[], bf16[64,64]{1,0}) while(%init), condition=%g_cond, body=%g_body
  %c1 = bf16[512,64]{1,0} call(%a), calls=%called
  ROOT %c2 = bf16[512,64]{1,0} call(%a), to_apply=%applied
}

ENTRY %main (x: bf16[64,64]) -> bf16[512,64] {
  %x = bf16[64,64]{1,0} parameter(0)
  %cs = ((bf16[64,64]{1,0}), bf16[512,64]{1,0}) call-start(%x), async_execution_thread="sparsecore", to_apply=%offloaded
  ROOT %cd = bf16[512,64]{1,0} call-done(%cs)
}
"""
    k = kernels(text)
    assert k["loop_gather"].count == 2
    assert all(k[n].asynchronous for n in ("loop_gather", "call_gather", "apply_gather"))
