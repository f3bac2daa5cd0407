"""The serving plan's arithmetic against values worked out by hand (each docstring shows it): the model's
bytes per GPU and those a decode step reads whole, KV bytes per position by cache dtype and GPU count,
where cuDNN's fused attention is planned (compute capability 8.0 and up), the bandwidth floor no decode
step beats (weights read + the cache a step reads), the engine's steady state, and the extra attention of
long prompts prefilled in chunks. The compiled programs' own figures are inputs here, written into the
planner's table of decode steps and the chunk, so that every output is a number a reader can check; the
compiles themselves are tested in tests/test_serving_plan.py."""

import jax
import pytest
from flax import nnx

from migration.config.serving import CHUNK, ServeRequest
from migration.hardware import GPU_SPECS
from migration.planning.capacity import (budget_bound_concurrency, chunked_attention_flops, kv_bound_concurrency,
                                         mix_figures, RequestClass, steady_state)
from migration.planning.serving import _Planner, kv_bytes_per_token, kv_cache_bytes, serve_row, serving_config
from migration.planning.steptime import CALIBRATION

# The tiny llama: 2 layers, d_model 64, 4 heads of 16 (2 kv heads), SwiGLU of 128, vocabulary 256, tied.
# Parameters: embedding 256 x 64 = 16,384; a layer: q 64 x 64 = 4,096, k and v 64 x 32 = 2,048 each, o 4,096,
# gate / up / down 64 x 128 = 8,192 each, two RMS norms of 64: 36,992; the final norm 64.
# 16,384 + 2 x 36,992 + 64 = 90,432 parameters, x 2 B in bf16 = 180,864 B.
TINY_BF16_BYTES = 180_864


def planner(target: str = "h100-sxm", gpus: int = 1, **kw) -> _Planner:
    return _Planner(ServeRequest("llama", "tiny", target, prompt_len=32, gen_len=16, gpus=gpus, **kw))


def test_the_tiny_llamas_bytes_per_gpu_whole_and_split_two_ways():
    """One GPU holds 180,864 B. Over two, Megatron's split halves each layer's q, k, v, o and MLP
    (36,864 parameters a layer -> 18,432) while the embedding (16,384) and the norms (2 x 128 + 64) stay
    whole: (16,384 + 2 x (18,432 + 128) + 64) x 2 B = 107,136 B. With a tied embedding and rotary positions
    there is no table a decode step only gathers rows of: it reads every byte."""
    one, two = planner(), planner(gpus=2)
    assert one.model["weights_bytes"] == one.model["weights_read_bytes"] == TINY_BF16_BYTES
    assert two.model["weights_bytes"] == two.model["weights_read_bytes"] == 107_136


def test_tables_a_decode_step_only_gathers_from_are_not_read_whole():
    """The GPT-2 layout learns its positions: a 64 x 64 table (tiny transformer, seq 64) a step gathers one
    row of per sequence, so 4,096 x 2 B = 8,192 B fewer are read whole than are held. Its embedding is tied
    (the head reads it whole)."""
    p = _Planner(ServeRequest("transformer", "tiny", "h100-sxm", prompt_len=32, gen_len=16))
    assert p.model["weights_bytes"] - p.model["weights_read_bytes"] == 8_192


@pytest.mark.parametrize("precision, kv_cache, gpus, expected", [
    ("bf16", "auto", 1, 256),  # 2 (k, v) x 2 layers x 2 kv heads x 16 x 2 B
    ("fp16", "auto", 1, 256),
    ("fp32", "auto", 1, 512),  # 4 B
    ("int8", "auto", 1, 256),  # int8 weights, the cache stays bf16
    ("bf16", "fp8", 1, 128),  # an e4m3 cache: 1 B
    ("bf16", "auto", 2, 128),  # the kv heads split over two GPUs
    ("bf16", "fp8", 2, 64),
])
def test_kv_bytes_per_position_by_cache_dtype_and_gpus(precision, kv_cache, gpus, expected):
    cfg = serving_config(ServeRequest("llama", "tiny", "h100-sxm", 32, 16, precision=precision),
                         GPU_SPECS["h100-sxm"])
    assert kv_bytes_per_token(cfg, precision, kv_cache, gpus) == expected


@pytest.mark.parametrize("target, precision, fused", [
    ("a100-80gb", "bf16", True),  # compute capability 8.0: the first with cuDNN's fused attention
    ("a10g", "fp16", True), ("h100-sxm", "int8", True), ("b200", "bf16", True),
    ("t4", "fp16", False), ("v100-32gb", "fp16", False),  # 7.5, 7.0
    ("h100-sxm", "fp32", False),  # fp32 compute
])
def test_the_prefill_runs_cudnn_attention_from_capability_8_0_in_half_precision(target, precision, fused):
    cfg = serving_config(ServeRequest("llama", "tiny", target, 32, 16, precision=precision), GPU_SPECS[target])
    assert cfg.attention == ("cudnn" if fused else "xla")


def test_a_users_attention_choice_and_a_head_size_cudnn_cannot_take_keep_xla():
    req = ServeRequest("llama", "tiny", "h100-sxm", 32, 16, model={"attention": "xla"})
    assert serving_config(req, GPU_SPECS["h100-sxm"]).attention == "xla"
    req = ServeRequest("llama", "tiny", "h100-sxm", 32, 16, model={"d_model": 544})  # heads of 136 > 128
    assert serving_config(req, GPU_SPECS["h100-sxm"]).attention == "xla"


DECODE_S, CHUNK_S, CHUNK_TOKENS = 2e-5, 1e-4, 32


def row_at_4(target: str = "h100-sxm", gpus: int = 1) -> tuple[_Planner, dict]:
    """serve_row at 4 running sequences, the compiled figures given: a decode step of 20 us (1 us of it
    communication) with 1,000 B of workspace, a 32-token prefill chunk of 100 us with 2,000 B."""
    p = planner(target, gpus)
    p.decodes[4] = {"seconds": DECODE_S, "peak_bytes": 250_000, "donated_bytes": 40_000, "communication_s": 1e-6,
                    "bytes": 300_000, "workspace_bytes": 1_000}
    chunk = {"seconds": CHUNK_S, "tokens": CHUNK_TOKENS, "peak_bytes": 200_000, "workspace_bytes": 2_000}
    return p, serve_row(p, 4, chunk)


def test_the_bandwidth_floor_reads_the_weights_and_the_cache_a_step_reads():
    """A decode step reads each running sequence's cache to the mean position reached: prompt 32 + half of
    16 generated = 40 positions x 256 B x 4 sequences = 40,960 B, beside the 180,864 B of weights:
    221,824 B. On an H100 SXM (3.35232 TB/s) no step beats 221,824 / 3.35232e12 = 66.17 ns. The compiled
    step moved 300,000 B: 1.352x what it must."""
    p, row = row_at_4()
    assert p.context == 40 and row["kv_cache_bytes_read"] == 40_960
    assert row["bandwidth_limit_tpot_s"] == pytest.approx(221_824 / 3.35232e12)
    assert row["bandwidth_limit_tpot_s"] == pytest.approx(66.17e-9, rel=1e-3)
    assert row["decode_bytes_over_needed"] == pytest.approx(300_000 / 221_824)


def test_the_floor_is_per_gpu_where_the_model_is_split():
    """Two H100s: each reads its 107,136 B of weights and its half of the cache (128 B a position):
    107,136 + 4 x 40 x 128 = 127,616 B at 3.35232 TB/s."""
    _, row = row_at_4(gpus=2)
    assert row["bandwidth_limit_tpot_s"] == pytest.approx(127_616 / 3.35232e12)
    assert row["kv_cache_bytes_read"] == 20_480


def test_the_engines_step_at_4_sequences_by_hand():
    """Each output token of the mix (prompt 32, 16 generated) brings 2 prompt tokens to prefill: 8 a step at
    4 sequences, at 100 us / 32 = 3.125 us each. Step (= TPOT) = 20 + 8 x 3.125 = 45 us; the prompt's own
    prefill fits in one step's leftover budget: TTFT = 1 x 20 + 32 x 3.125 = 120 us. Output 4 / 45 us =
    88,889 tokens/s, a request per 16 tokens: 5,556 requests/s. Peak: weights 180,864 + pages at full
    length 4 x 48 x 256 = 49,152 + the larger workspace (the chunk's 2,000) = 232,016 B."""
    p, row = row_at_4()
    assert row["prefill_tokens_per_step"] == 8
    assert row["predicted_tpot_s"] == pytest.approx(45e-6)
    assert row["predicted_ttft_s"] == pytest.approx(120e-6)
    assert row["tokens_per_s_per_gpu"] == pytest.approx(4 / 45e-6)
    assert row["requests_per_s"] == pytest.approx(4 / 45e-6 / 16)
    assert row["tpot_over_limit"] == pytest.approx(45e-6 / (221_824 / 3.35232e12))
    assert row["kv_cache_bytes"] == 49_152
    assert row["predicted_peak_bytes"] == 232_016
    assert row["fits"] and row["budget_bytes"] == int(GPU_SPECS["h100-sxm"].memory_bytes * p.req.memory_fraction)
    assert (row["decode_step_s"], row["decode_communication_s"], row["kv_cache_bytes_compiled"]) == (2e-5, 1e-6, 40_000)


def test_two_gpus_share_the_servers_tokens():
    """The server's output is the same 4 / 45 us; per GPU it is half."""
    _, row = row_at_4(gpus=2)
    assert row["tokens_per_s_per_gpu"] == pytest.approx(4 / 45e-6 / 2)


def test_a_mix_averages_over_running_sequences_and_requests():
    """Three quarters of requests 100:10, a quarter 1,000:90. Running sequences go by share x generation
    (7.5 : 22.5): pages held (7.5 x 110 + 22.5 x 1,090) / 30 = 845; positions read (7.5 x 105 + 22.5 x
    1,045) / 30 = 810; per request 325 prompt tokens for 30 generated: 10.833 prompt tokens an output."""
    fig = mix_figures((RequestClass(0.75, 100, 10), RequestClass(0.25, 1000, 90)))
    assert fig.tokens_held == pytest.approx(845)
    assert fig.context_read == pytest.approx(810)
    assert (fig.mean_prompt, fig.mean_gen, fig.longest) == (pytest.approx(325), pytest.approx(30), 1090)
    assert fig.prompt_per_output == pytest.approx(325 / 30)


def test_a_long_prompt_needs_several_steps_of_leftover_budget():
    """Chunk 64, 60 sequences running: 4 tokens of budget a step are left for prompts, so a 32-token prompt
    takes 8 steps of 1 ms decode each, plus its prefill 32 x 1 us and its long-prompt extra 0.5 ms:
    8 + 0.032 + 0.5 = 8.532 ms."""
    fig = mix_figures((RequestClass(1.0, 32, 16),))
    state = steady_state(60, 1e-3, 1e-6, 5e-4, fig, 64)
    assert state.ttft_s == pytest.approx(8.532e-3)
    # the step: 1 ms + 120 prompt tokens x 1 us + 60 / 16 requests finishing x 0.5 ms = 2.995 ms
    assert state.step_s == pytest.approx(1e-3 + 120e-6 + 60 / 16 * 5e-4)


def test_chunks_attending_to_earlier_chunks_by_hand():
    """A 4,096-token prompt in chunks of 1,024: chunk k reads k x 1,024 earlier positions, 0 + 1 + 2 + 3 = 6
    chunk-squares; a query-key pair costs 4 x heads x head size FLOPs a layer (two products). The 1B llama
    (16 layers, 32 heads of 64): 4 x 32 x 64 x 16 x 1,024^2 x 6 = 824,633,720,832 FLOPs. A prompt of one
    chunk or less attends to no earlier chunk."""
    assert chunked_attention_flops(4096, 1024, 16, 32, 64) == 824_633_720_832
    assert chunked_attention_flops(1024, 1024, 16, 32, 64) == 0.0
    assert chunked_attention_flops(2048, 1024, 1, 1, 1) == 4 * 1024 * 1024 * 1


def test_the_long_prompt_extra_time_at_the_calibrated_attention_share():
    """The same FLOPs for each request of a 4,096:256 mix with 1,024-token chunks, on one H100 SXM in bf16
    (989 TFLOP/s dense) at cuDNN attention's calibrated share (0.65): 824,633,720,832 / (989e12 x 0.65)
    = 1.283 ms; on two GPUs half of it. A prompt that fits in one chunk adds nothing."""
    req = ServeRequest("llama", "1b", "h100-sxm", prompt_len=4096, gen_len=256, chunk=1024)
    assert CALIBRATION.attention == 0.65
    assert _Planner(req).long_prompt_s() == pytest.approx(824_633_720_832 / (989e12 * 0.65))
    two = ServeRequest("llama", "1b", "h100-sxm", prompt_len=4096, gen_len=256, chunk=1024, gpus=2)
    assert _Planner(two).long_prompt_s() == pytest.approx(824_633_720_832 / (989e12 * 0.65) / 2)
    assert CHUNK >= 1024
    short = ServeRequest("llama", "1b", "h100-sxm", prompt_len=1024, gen_len=256, chunk=1024)
    assert _Planner(short).long_prompt_s() == 0.0


def test_int8_weights_take_the_bf16_attention_peak():
    """int8 serving computes attention in bf16: the extra time is the bf16 one."""
    bf16 = ServeRequest("llama", "1b", "h100-sxm", prompt_len=4096, gen_len=256, chunk=1024)
    int8 = ServeRequest("llama", "1b", "h100-sxm", prompt_len=4096, gen_len=256, chunk=1024, precision="int8")
    assert _Planner(int8).long_prompt_s() == pytest.approx(_Planner(bf16).long_prompt_s())


def test_the_kv_pool_bounds_the_concurrency_by_whole_sequences():
    """10,000 B free over sequences of 300 positions x 10 B = 3,000 B each: 3 of them (3.33 rounds down).
    Nothing free, or less than nothing (the weights and workspace alone exceed the budget): none."""
    assert kv_bound_concurrency(10_000, 10, 300) == 3
    assert kv_bound_concurrency(1, 0.5, 1) == 2  # 1 B over half a byte a sequence
    assert kv_bound_concurrency(0, 10, 300) == 0
    assert kv_bound_concurrency(-1, 10, 300) == 0


def test_the_token_budget_bounds_the_concurrency():
    """Each running sequence takes one decode token and `prompt per output` prompt tokens a step: a
    2,048-token budget at 3 prompt tokens an output sustains 2,048 / 4 = 512; with no prompt, 2,048."""
    assert budget_bound_concurrency(2048, 3.0) == 512
    assert budget_bound_concurrency(2048, 0.0) == 2048
    assert budget_bound_concurrency(100, 10.833) == 8  # 100 / 11.833 = 8.45


def test_a_full_budget_leaves_one_token_a_step_for_prompts():
    """Chunk 16 with 16 sequences running leaves no budget: the engine still gives a prompt one token a
    step, so a 32-token prompt takes 32 steps of 1 ms, plus 32 x 1 us of prefill: 32.032 ms."""
    fig = mix_figures((RequestClass(1.0, 32, 16),))
    state = steady_state(16, 1e-3, 1e-6, 0.0, fig, 16)
    assert state.concurrency == 16
    assert state.ttft_s == pytest.approx(32.032e-3)
    assert steady_state(15, 1e-3, 1e-6, 0.0, fig, 16).ttft_s == pytest.approx(32.032e-3)  # 1 left: the same


def test_the_kv_cache_of_a_batch_by_hand():
    """The tiny llama (2 layers, 2 kv heads of 16) caching 5 positions for 3 sequences in bf16:
    2 x 2 x 2 x 16 x 5 x 3 x 2 B = 3,840 B."""
    cfg = serving_config(ServeRequest("llama", "tiny", "h100-sxm", 32, 16), GPU_SPECS["h100-sxm"])
    assert kv_cache_bytes(cfg, 3, 5, 2) == 3_840


def test_cudnn_takes_heads_up_to_128():
    """d_model 512 over 4 heads: heads of 128, the largest cuDNN's fused attention takes."""
    req = ServeRequest("llama", "tiny", "h100-sxm", 32, 16, model={"d_model": 512})
    cfg = serving_config(req, GPU_SPECS["h100-sxm"])
    assert cfg.head_dim == 128 and cfg.attention == "cudnn"


def test_an_untied_embedding_is_held_but_only_gathered_from():
    """Untied, the tiny llama adds a 256 x 64 head: 90,432 + 16,384 = 106,816 parameters, 213,632 B in
    bf16; the input embedding (16,384 x 2 B = 32,768 B) is only gathered from, so a step reads 180,864 B."""
    p = _Planner(ServeRequest("llama", "tiny", "h100-sxm", 32, 16, model={"tied_embeddings": False}))
    assert p.model["weights_bytes"] == 213_632
    assert p.model["weights_read_bytes"] == 213_632 - 32_768


def test_the_model_state_is_what_the_compiles_take():
    """The abstract state the serving programs are compiled with: one GPU's leaves sum to its bytes."""
    p = planner()
    assert isinstance(p.model["graphdef"], nnx.GraphDef)
    leaves = jax.tree.leaves(p.model["state"])
    assert sum(leaf.size * leaf.dtype.itemsize for leaf in leaves) == TINY_BF16_BYTES
    assert p.compiles == 0  # nothing compiled until a program is asked for


@pytest.mark.parametrize("target, gpus, link", [
    ("h100-sxm", 1, None),  # one GPU: no collectives
    ("h100-sxm", 2, 450e9),  # NVLink 4: 900 GB/s both ways, 450 GB/s one way
    ("l4", 4, 32e9),  # PCIe gen4 x16
])
def test_the_decode_steps_collectives_cross_the_nodes_links(target, gpus, link):
    assert planner(target, gpus).link == link


def test_an_fp8_cache_halves_the_bytes_the_planner_holds_per_position():
    assert planner().per_token == 256 and planner(kv_cache="fp8").per_token == 128


def test_the_long_prompt_extra_time_in_fp32_is_at_the_fp32_peak():
    """fp32 attention runs at the H100's 67 TFLOP/s (not its bf16 989): 824,633,720,832 / (67e12 x 0.65).
    A T4 has no bf16 units: int8 serving there takes its fp32 peak (8.1 TFLOP/s)."""
    req = ServeRequest("llama", "1b", "h100-sxm", prompt_len=4096, gen_len=256, chunk=1024, precision="fp32")
    assert _Planner(req).long_prompt_s() == pytest.approx(824_633_720_832 / (67e12 * 0.65))
    t4 = ServeRequest("llama", "1b", "t4", prompt_len=4096, gen_len=256, chunk=1024, precision="int8")
    assert _Planner(t4).long_prompt_s() == pytest.approx(824_633_720_832 / (8.1e12 * 0.65))


def test_the_row_carries_the_compiled_figures_it_was_built_from():
    p, row = row_at_4()
    assert (row["batch"], row["gpus"], row["weights_bytes"], row["weights_read_bytes"]) == (
        4, 1, TINY_BF16_BYTES, TINY_BF16_BYTES)
    assert (row["decode_context"], row["prefill_peak_bytes"], row["decode_peak_bytes"], row["decode_bytes"]) == (
        40, 200_000, 250_000, 300_000)
    p.budget = 232_016  # exactly the peak: it fits
    assert serve_row(p, 4, {"seconds": CHUNK_S, "tokens": CHUNK_TOKENS, "peak_bytes": 200_000,
                            "workspace_bytes": 2_000})["fits"]
    p.budget = 232_015
    assert not serve_row(p, 4, {"seconds": CHUNK_S, "tokens": CHUNK_TOKENS, "peak_bytes": 200_000,
                                "workspace_bytes": 2_000})["fits"]
