"""The step-time model's figures against values worked out by hand, one branch at a time: each docstring
shows the arithmetic. The calibration is the fitted one (`steptime.CALIBRATION`; refitted only by
`python bench/published_check.py --fit`), pinned here so that the hand arithmetic and the model read
the same constants."""

import pytest

from migration.hardware import GPU_SPECS, Links
from migration.planning import steptime
from migration.planning.hlo_cost import Kernel

H100 = GPU_SPECS["h100-sxm"]  # 989 TFLOP/s bf16 dense, 67 TFLOP/s fp32, 1,979 fp8, 3.35232 TB/s
B200 = GPU_SPECS["b200"]
CAL = steptime.CALIBRATION
NVLINK = 450e9  # an H100 SXM node's NVLink, bytes/s per GPU one way


def collective(kind: str, group: int, nbytes: float = 1e9, **kw) -> Kernel:
    return Kernel(kind, kind, 0.0, nbytes, None, 1, group=group, **kw)


def test_the_fitted_calibration_is_the_one_the_arithmetic_below_uses():
    assert (CAL.matmul, CAL.attention, CAL.memory, CAL.launch_s, CAL.link, CAL.collective_s) == (
        0.60, 0.65, 0.90, 8e-6, 0.60, 2e-5)
    assert (H100.peak_flops("bf16"), H100.peak_flops("fp32"), H100.bandwidth_bytes_per_s) == (989e12, 67e12, 3.35232e12)


@pytest.mark.parametrize("kind, group, expected", [
    # a ring moves (n-1)/n of the data per device; an all-reduce is a reduce-scatter then an all-gather: twice
    ("all-reduce", 8, 2 * 7 / 8 * 1e9 / (450e9 * 0.60) + 2e-5),  # 6.4815 ms + 20 us = 6.5015 ms
    ("all-reduce", 2, 2 * 1 / 2 * 1e9 / (450e9 * 0.60) + 2e-5),  # 3.7037 ms + 20 us
    ("all-gather", 8, 1 * 7 / 8 * 1e9 / (450e9 * 0.60) + 2e-5),  # 3.2407 ms + 20 us
    ("reduce-scatter", 4, 1 * 3 / 4 * 1e9 / (450e9 * 0.60) + 2e-5),  # 2.7778 ms + 20 us
    ("all-to-all", 8, 1 * 7 / 8 * 1e9 / (450e9 * 0.60) + 2e-5),
    ("collective-permute", 8, 1e9 / (450e9 * 0.60) + 2e-5),  # a permute sends its whole operand once
    ("all-reduce", 1, 0.0),  # a group of one moves nothing and costs nothing
])
def test_a_collective_costs_its_rings_share_of_the_bytes_over_the_link_plus_a_fixed_latency(kind, group, expected):
    """1 GB over 450 GB/s NVLink at 60% of it: 1e9 / 270e9 = 3.7037 ms per full copy of the data."""
    seconds = steptime.collective_seconds(collective(kind, group), NVLINK)
    assert seconds == pytest.approx(expected, rel=1e-12)


def test_an_all_reduce_costs_twice_an_all_gather_of_the_same_bytes_less_the_fixed_latency():
    reduce = steptime.collective_seconds(collective("all-reduce", 16), NVLINK) - CAL.collective_s
    gather = steptime.collective_seconds(collective("all-gather", 16), NVLINK) - CAL.collective_s
    assert reduce == pytest.approx(2 * gather) and gather == pytest.approx(15 / 16 * 1e9 / 270e9)


def test_a_collective_across_nodes_runs_one_ring_per_gpu_of_a_node_over_its_nic():
    """16 GPUs over 2 nodes, 50 GB/s of network per GPU: 8 rings x 50 GB/s = 400 GB/s (under NVLink's
    450); an all-gather of 1 GB: 15/16 x 1e9 / (400e9 x 0.60) = 3.90625 ms, + 20 us. With 2 GPUs per node
    (4 nodes of 8 with a group of 8 spanning all 4 nodes): 2 rings x 50 = 100 GB/s: 7/8 x 1e9 / 60e9."""
    links = Links(intra=NVLINK, network=50e9)
    across = steptime.collective_seconds(collective("all-gather", 16, nodes=2), links)
    assert across == pytest.approx(15 / 16 * 1e9 / (400e9 * 0.60) + 2e-5)
    sparse = steptime.collective_seconds(collective("all-gather", 8, nodes=4), links)
    assert sparse == pytest.approx(7 / 8 * 1e9 / (100e9 * 0.60) + 2e-5)
    inside = steptime.collective_seconds(collective("all-gather", 8, nodes=1), links)
    assert inside == pytest.approx(7 / 8 * 1e9 / (450e9 * 0.60) + 2e-5)
    # no figure for the network: not timed rather than timed over NVLink
    assert steptime.collective_seconds(collective("all-gather", 16, nodes=2), Links(intra=NVLINK)) == 0.0


def test_cross_domain_seconds_prices_only_the_collectives_that_leave_a_node_both_ways():
    links = Links(intra=NVLINK, network=50e9)
    kernels = [collective("all-reduce", 16, nodes=2), collective("all-gather", 8, nodes=1)]
    network, inside = steptime.cross_domain_seconds(kernels, links)
    assert network == pytest.approx(2 * 15 / 16 * 1e9 / (400e9 * 0.60) + 2e-5)
    assert inside == pytest.approx(2 * 15 / 16 * 1e9 / (450e9 * 0.60) + 2e-5)


@pytest.mark.parametrize("kind, unit, efficiency, peak", [
    ("matmul", "bf16", 0.60, 989e12),
    ("attention", "bf16", 0.65, 989e12),  # cuDNN's fused attention reaches a higher share of the peak
    ("matmul", "fp8", 0.60, 1979e12),
    ("matmul", "fp32", 0.60, 67e12),  # an fp32 product runs at the fp32 (non-tensor-core) peak
    ("convolution", "bf16", 0.60, 989e12),
])
def test_a_compute_bound_kernel_takes_its_flops_at_its_units_share_of_the_peak(kind, unit, efficiency, peak):
    """1 PFLOP of work, few bytes: 1e15 / (peak x efficiency) + one launch of 8 us; e.g. bf16 matmul
    1e15 / (989e12 x 0.60) = 1.68521 s."""
    k = Kernel("k", kind, 1e15, 1e6, unit, 1)
    assert steptime.kernel_seconds(k, H100) == pytest.approx(1e15 / (peak * efficiency) + 8e-6, rel=1e-12)


def test_a_memory_bound_kernel_takes_its_bytes_at_ninety_percent_of_hbm_and_pays_every_launch():
    """3 GB moved by a kernel launched 100 times a step (a loop body): 3e9 / (3.35232e12 x 0.90) = 994.36 us,
    plus 100 x 8 us = 800 us."""
    k = Kernel("k", "memory", 0.0, 3e9, None, 100)
    assert steptime.kernel_seconds(k, H100) == pytest.approx(3e9 / (3.35232e12 * 0.90) + 100 * 8e-6, rel=1e-12)
    # a product with more bytes than its FLOPs can use is bound by the bytes: 1 GFLOP and 3 GB
    small = Kernel("k", "matmul", 1e9, 3e9, "bf16", 1)
    assert steptime.kernel_seconds(small, H100) == pytest.approx(3e9 / (3.35232e12 * 0.90) + 8e-6, rel=1e-12)


def test_a_unit_the_gpu_lacks_falls_back_to_its_fp32_peak():
    """A V100 has no bf16 tensor cores in the catalog: a bf16 product runs at its fp32 peak."""
    v100 = GPU_SPECS["v100-32gb"]
    assert not v100.peak_flops("bf16")
    k = Kernel("k", "matmul", 1e13, 0.0, "bf16", 1)
    assert steptime.kernel_seconds(k, v100) == pytest.approx(1e13 / (v100.peak_flops("fp32") * 0.60) + 8e-6)


def test_the_step_adds_kernels_and_exposes_only_the_collectives_compute_cannot_hide():
    """On a B200 (2,250 TFLOP/s bf16, 7.67232 TB/s): a matmul of 1.35 PFLOP = 1.35e15 / 1.35e15 = 1 s
    (+8 us); a memory kernel of 6.905088 GB = 1 ms (+8 us); an asynchronous all-reduce over 8 GPUs of
    x bytes that takes 1.5 s: 0.5 s of it exposed (less the 16 us of launches); a synchronous
    all-gather of 270 MB over 8: 7/8 x 0.27e9 / 270e9 = 0.875 ms + 20 us, all exposed."""
    matmul = Kernel("m", "matmul", 1.35e15, 0.0, "bf16", 1)
    stream = Kernel("s", "memory", 0.0, 7.67232e12 * 0.90 * 1e-3, None, 1)
    async_bytes = (1.5 - 2e-5) * 270e9 / (2 * 7 / 8)
    hidden = collective("all-reduce", 8, async_bytes, asynchronous=True)
    exposed = collective("all-gather", 8, 0.27e9)
    p = steptime.predict([matmul, stream, hidden, exposed], B200, NVLINK)
    compute = 1.0 + 8e-6 + 1e-3 + 8e-6
    assert p.compute_s == pytest.approx(compute) and p.matmul_s == pytest.approx(1.0 + 8e-6)
    assert p.memory_s == pytest.approx(1e-3 + 8e-6)
    assert p.communication_s == pytest.approx(1.5 + 7 / 8 * 0.27e9 / 270e9 + 2e-5)
    assert p.exposed_communication_s == pytest.approx(1.5 - compute + 7 / 8 * 0.27e9 / 270e9 + 2e-5)
    assert p.seconds == pytest.approx(1.5 + 7 / 8 * 0.27e9 / 270e9 + 2e-5)
    assert p.flops == 1.35e15 and p.kernels == 2  # collectives are not counted as kernel launches


def test_accumulation_loops_count_every_launch_of_the_body():
    """A body run 4 times (gradient accumulation): the kernel's count is 4; launches and FLOPs are summed
    as given (the HLO reader multiplies by trip counts)."""
    k = Kernel("k", "matmul", 4e12, 0.0, "bf16", 4)
    p = steptime.predict([k], H100, None)
    assert p.kernels == 4 and p.seconds == pytest.approx(4e12 / (989e12 * 0.60) + 4 * 8e-6)


def test_every_kernel_and_collective_adds_to_its_sum():
    """Two of each: matmuls of 1 ms each (0.6 x 989e12 x 1e-3 FLOPs), memory kernels of 1 ms each
    (0.9 x 3.35232e12 x 1e-3 bytes), asynchronous all-gathers of 2 ms each and synchronous ones of 3 ms
    each over 2 GPUs (1/2 of the bytes over 270 GB/s, + 20 us). Compute 4 ms + 4 launches of 8 us;
    asynchronous 4.04 ms, of which 4.04 - 4.032 = 8 us exposed; synchronous 6.04 ms, all exposed."""
    matmul = Kernel("m", "matmul", 0.6 * 989e12 * 1e-3, 0.0, "bf16", 1)
    stream = Kernel("s", "memory", 0.0, 0.9 * 3.35232e12 * 1e-3, None, 1)
    hidden = collective("all-gather", 2, 2e-3 * 270e9 * 2, asynchronous=True)
    exposed = collective("all-gather", 2, 3e-3 * 270e9 * 2)
    p = steptime.predict([matmul, matmul, stream, stream, hidden, hidden, exposed, exposed], H100, NVLINK)
    assert p.matmul_s == pytest.approx(2e-3 + 2 * 8e-6) and p.memory_s == pytest.approx(2e-3 + 2 * 8e-6)
    assert p.communication_s == pytest.approx(4.04e-3 + 6.04e-3)
    assert p.exposed_communication_s == pytest.approx(4.04e-3 - 4.032e-3 + 6.04e-3)
    assert p.flops == pytest.approx(2 * 0.6 * 989e12 * 1e-3) and p.kernels == 4


def test_a_collective_launched_in_a_loop_pays_its_latency_every_time():
    """An all-reduce run 4 times a step (count 4, bytes summed over the trips): 4 x 20 us of latency."""
    looped = Kernel("ar", "all-reduce", 0.0, 1e9, None, 4, group=8)
    assert steptime.collective_seconds(looped, NVLINK) == pytest.approx(1.75e9 / 270e9 + 4 * 2e-5)


def test_a_kernel_with_flops_but_no_product_unit_is_timed_by_its_bytes():
    """A reduction XLA counts FLOPs for but runs on no matrix unit: only its 3 GB at 90% of HBM."""
    k = Kernel("reduce", "memory", 1e15, 3e9, None, 1)
    assert steptime.kernel_seconds(k, H100) == pytest.approx(3e9 / (3.35232e12 * 0.90) + 8e-6)


def test_cross_domain_seconds_uses_the_calibration_it_is_given():
    cal = steptime.Calibration(matmul=0.5, attention=0.5, memory=0.5, launch_s=0.0, link=1.0, collective_s=0.0)
    network, inside = steptime.cross_domain_seconds([collective("all-gather", 16, nodes=2)],
                                                    Links(intra=NVLINK, network=50e9), cal)
    assert network == pytest.approx(15 / 16 * 1e9 / 400e9) and inside == pytest.approx(15 / 16 * 1e9 / 450e9)


def test_the_method_line_states_the_programs_figures_in_their_units():
    """2.5e12 FLOPs = 2.50 TFLOP; H100's 3.35232e12 B/s = 3.35 TB/s; 1.5 ms of collectives, 250 us exposed."""
    p = steptime.StepPrediction(seconds=0.01, compute_s=0.009, matmul_s=0.008, memory_s=0.001, communication_s=1.5e-3,
                                exposed_communication_s=2.5e-4, flops=2.5e12, kernels=1234)
    text = p.method(H100, "NVLink")
    assert "1,234 kernel launches, 2.50 TFLOP per GPU" in text
    assert "its bytes at 90% of 3.35 TB/s" in text and "at 60% of" in text
    assert "collectives 1.5 ms over NVLink (250 µs not hidden behind compute)" in text
    assert "expected error about ±25%" in text and "±40%" in p.method(H100, "NVLink", 0.40)
