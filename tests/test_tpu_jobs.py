"""The TPU side as TPU jobs run: MaxText's remat policies (by name, and `custom` tensor by tensor, the layer
input offloaded included), the decoder's MLP activation as a free dimension, slices named as Google Cloud
names them (several of them too), FSDP across slices, and a TPU answer when the stated setup needs more HBM
than the chip has: the cheapest setup that the TPU compiler fits (by the step model), compiled and
timed, used by the comparison and labelled as the product's assumption."""

import dataclasses
import re

import pytest

from migration.common import ConfigError
from migration.config import forms
from migration.config.fields import FIELD
from migration.config.imported import read_config_bytes, with_imported
from migration.config.limits import (
    MAXTEXT_REMAT,
    MAXTEXT_TENSORS,
    REMAT_NAMES,
    REMAT_TENSORS,
    check_remat_name,
    maxtext_custom,
)
from migration.config.requests import PlanRequest, RunConfig, validate_plan_request
from migration.hardware import TPU_SPECS, parse_tpu_slice
from migration.planning import compare
from migration.planning.source import (
    TpuSetup,
    cheapest_fit,
    compile_for_source_tpu,
    tpu_fit_ladders,
    tpu_topology,
)
from migration.step.train import TrainProgram, abstract_batch, abstract_state, jit_step, make_multislice_mesh
from workloads import get_workload
from workloads.maxtext_config import MAXTEXT_MLPS, MAXTEXT_REMAT_NAMES, MAXTEXT_REMAT_TENSORS
from workloads.transformer import CHECKPOINT_NAMES, MLPS, ModelConfigError


# -- remat policies in MaxText's names ---------------------------------------------------------------------

def test_maxtexts_policy_and_tensor_names_are_one_list_on_both_sides_of_the_reader():
    assert set(MAXTEXT_REMAT) == set(MAXTEXT_REMAT_NAMES)  # the reader's names are the ones translated
    assert set(MAXTEXT_TENSORS) == set(MAXTEXT_REMAT_TENSORS)
    assert set(REMAT_TENSORS) == set(CHECKPOINT_NAMES)  # every tag the decoder sets can be placed
    for name, ours in MAXTEXT_REMAT.items():
        assert check_remat_name("source_remat", name, maxtext=True) == ours
        assert ours in REMAT_NAMES or ours.startswith("custom:")
    assert set(MAXTEXT_MLPS.values()) == set(MLPS)  # every activation the decoder has, read from MaxText


def test_a_custom_policy_is_canonical_and_maxtexts_fused_names_keep_the_most():
    # key_proj and value_proj are one fused projection here: it keeps what the more kept of the two keeps
    assert maxtext_custom({"decoder_layer_input": "offload", "key_proj": "remat", "value_proj": "device",
                           "context": "offload", "mlpwo": "remat"}) == \
        "custom:decoder_layer_input=offload,kv_proj=device,attention_out=offload"
    assert check_remat_name("remat", "custom:kv_proj=offload,query_proj=device") == \
        "custom:query_proj=device,kv_proj=offload"  # one spelling, one compile key
    for bad, named in (("custom:mlp=device", "mlp=device"), ("custom:query_proj=host", "query_proj=host"),
                       ("minimal", "minimal"), ("save_everything", "save_everything")):
        with pytest.raises(ConfigError) as info:
            check_remat_name("source_remat", bad)  # MaxText's names only where the TPU job is described
        assert str(info.value).startswith("source_remat: ") and named in str(info.value)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="remat: MaxText's custom policy names"):
        maxtext_custom({"attention_scores": "device"})


def test_a_plan_request_takes_the_tpu_jobs_policy_in_maxtexts_name_and_refuses_others_in_one_line():
    req = validate_plan_request(PlanRequest(workload="llama", preset="tiny", source_remat="qkv_proj_offloaded"))
    assert req.tpu_remat == "custom:query_proj=offload,kv_proj=offload"
    with pytest.raises(ConfigError, match=r"^source_remat: must be one of none, .* got 'remat_everything'$"):
        validate_plan_request(PlanRequest(workload="llama", preset="tiny", source_remat="remat_everything"))
    with pytest.raises(ConfigError, match="^source_remat: .* does not apply to mlp"):  # the MLP tags no q, k, v
        validate_plan_request(PlanRequest(workload="mlp", preset="tiny", source_remat="save_qkv_proj"))


def _tpu_memory(cfg: RunConfig, source: str) -> object:
    spec = TPU_SPECS[source]
    program = TrainProgram.from_config(cfg)
    mesh = make_multislice_mesh(tpu_topology(spec).devices, program.sharding, 1)
    return jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile(
    ).memory_analysis()


def test_offloading_the_layer_input_moves_the_scans_saved_carry_to_host_memory():
    """The TPU recipes' policy (decoder_layer_input=offload): each layer's input, which the layer scan keeps
    for the backward pass, waits in host memory; compiled for a TPU slice by libtpu. Nothing else is
    offloaded, so without the tag's offload the host would hold nothing."""
    model = {"n_layers": 4, "d_model": 256, "n_heads": 4, "n_kv_heads": 4, "d_ff": 512, "vocab_size": 1024,
             "seq_len": 128, "attention": "xla"}  # XLA's attention: the kernel is not what is tried here
    cfg = RunConfig(workload="llama", preset="tiny", model=model, per_device_batch=8, devices=4, precision="bf16",
                    sharding="fsdp", remat="custom:decoder_layer_input=offload")
    memory = _tpu_memory(cfg, "tpu-v5e-4")
    layer_inputs = 4 * 8 * 128 * 256 * 2  # layers x batch x tokens x d_model in bf16
    assert layer_inputs <= memory.host_temp_size_in_bytes <= 1.5 * layer_inputs


# -- the MLP's activation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mlp", MLPS)
def test_each_mlp_activation_is_counted_as_its_program_computes_it(mlp):
    """The analytic counts the planner uses equal the traced program's, for each activation; a gate adds one
    d_model x d_ff matrix a layer and nothing else."""
    w = get_workload("llama")
    cfg = w.config("tiny", {"mlp": mlp})
    facts = w.facts(cfg)
    assert w.param_count(cfg) == facts.params
    assert facts.train_flops == pytest.approx(w.flops_per_example(cfg), rel=1e-9)
    plain = w.config("tiny", {"mlp": "relu"})
    assert w.param_count(cfg) - w.param_count(plain) == (cfg.n_layers * cfg.d_model * cfg.d_ff if cfg.gated else 0)


def test_an_activation_not_in_the_list_is_one_line_naming_the_field():
    with pytest.raises(ModelConfigError) as info:
        get_workload("llama").config("tiny", {"mlp": "swish"})
    assert "mlp" in str(info.value) and "gelu, swiglu, geglu, relu, squared_relu" in str(info.value)
    with pytest.raises(ConfigError, match="^mlp: must be one of"):
        forms.plan_request(workload="llama", preset="tiny", mlp="swish")
    assert set(FIELD["mlp"].allowed()) == {"preset", *MLPS}
    assert forms.plan_request(workload="llama", preset="tiny", mlp="relu").model["mlp"] == "relu"


# -- slices as users name them ---------------------------------------------------------------------------------

def test_slices_named_as_google_cloud_names_them_and_several_of_them():
    assert parse_tpu_slice("v5p-1024") == ("tpu-v5p-1024", 1)
    assert parse_tpu_slice("v5litepod-256") == ("tpu-v5e-256", 1)
    assert parse_tpu_slice("2xv6e-256") == ("tpu-v6e-256", 2)
    assert parse_tpu_slice("2 x v5p-4096") == ("tpu-v5p-4096", 2)
    assert parse_tpu_slice("tpu7x-128") == ("tpu7x-128", 1)
    req = forms.plan_request(workload="llama", preset="tiny", source="2xv6e-256", global_batch=512)
    assert (req.source, req.source_slices, req.source_devices) == ("tpu-v6e-256", 2, 512)
    assert forms.plan_request(workload="llama", preset="tiny", source="4xv5p-512", source_slices=4).source_slices == 4
    with pytest.raises(ConfigError, match="^source_slices: the source names 2 slices"):
        forms.plan_request(workload="llama", preset="tiny", source="2xv6e-256", source_slices=3)


@pytest.mark.parametrize("bad, says", [
    ("v5p-1000", "v5p slices are v5p-8, v5p-16"), ("0xv6e-256", "a job of 1 to 64 slices"),
    ("65xv6e-256", "a job of 1 to 64 slices"), ("v9-8", "a TPU slice as Google Cloud names it"),
    ("v5p-8; rm -rf /", "a TPU slice as Google Cloud names it"), ("x" * 5000, "a TPU slice")])
def test_a_slice_that_does_not_exist_is_one_line_naming_the_source(bad, says):
    with pytest.raises(ConfigError) as info:
        forms.plan_request(workload="llama", preset="tiny", source=bad)
    text = str(info.value)
    assert text.startswith("source: ") and says in text and "\n" not in text and len(text) < 400


# -- MaxText configs: remat, activations, slices -----------------------------------------------------------

RECIPE = b"""
base_emb_dim: 1024
base_num_query_heads: 8
base_num_kv_heads: 8
base_mlp_dim: 4096
base_num_decoder_layers: 4
head_dim: 128
vocab_size: 32000
mlp_activations: ["relu"]
logits_via_embedding: true
max_target_length: 2048
per_device_batch_size: 2
remat_policy: custom
decoder_layer_input: offload
query_proj: offload
key_proj: offload
value_proj: device
mlpwo: remat
dcn_fsdp_parallelism: 2
dtype: "bfloat16"
"""


def test_a_maxtext_config_gives_its_remat_policy_activation_and_fsdp_across_slices_to_the_tpu_side():
    imported = read_config_bytes(RECIPE, "recipe.yml")
    assert imported.model["mlp"] == "relu"
    req = with_imported(PlanRequest(source="tpu-v5p-8"), imported, given={"source"})
    assert req.source_remat == "custom:decoder_layer_input=offload,query_proj=offload,kv_proj=device"
    assert req.source_dcn_fsdp and req.source_slices == 2 and req.global_batch == 2 * 4 * 2
    assert any("remat_policy=custom (decoder_layer_input=offload" in n for n in req.config_notes)
    named = with_imported(PlanRequest(source="tpu-v5p-8"),
                          read_config_bytes(RECIPE.replace(b"remat_policy: custom", b"remat_policy: minimal"), "r.yml"),
                          given={"source"})
    assert named.source_remat == "dots_no_batch"
    for bad, says in ((b"remat_policy: everything", "remat_policy='everything': not one of MaxText's policies"),
                      (b"mlp_activations: [\"tanh\"]", "mlp_activations=['tanh']: the decoder here computes")):
        text = RECIPE.replace(b"remat_policy: custom", bad) if b"remat" in bad else RECIPE.replace(
            b'mlp_activations: ["relu"]', bad)
        with pytest.raises(ConfigError, match=re.escape(says)):
            read_config_bytes(text, "r.yml")


def test_a_maxtext_config_gives_its_tensor_parallelism_inside_a_slice_to_the_tpu_side():
    tp = RECIPE.replace(b"dcn_fsdp_parallelism: 2", b"ici_tensor_parallelism: 4")
    req = with_imported(PlanRequest(source="tpu-v5p-32"), read_config_bytes(tp, "tp.yml"), given={"source"})
    assert req.source_tensor == 4 and req.source_slices == 1
    assert any(n.startswith("ici_tensor_parallelism=4: ") for n in req.config_notes)
    assert validate_plan_request(req).source_tensor == 4
    # tensor parallelism across slices is still not planned: an error naming the key
    with pytest.raises(ConfigError, match="dcn_tensor_parallelism=2: the TPU side is planned with"):
        read_config_bytes(RECIPE.replace(b"dcn_fsdp_parallelism: 2", b"dcn_tensor_parallelism: 2"), "r.yml")
    with pytest.raises(ConfigError, match="ici_tensor_parallelism: expected an integer from 1"):
        read_config_bytes(RECIPE.replace(b"dcn_fsdp_parallelism: 2", b"ici_tensor_parallelism: -1"), "r.yml")


@pytest.mark.parametrize("given, says", [
    (dict(source_tensor=3), "a power of two that divides the slice's 4 devices"),
    (dict(source_tensor=8), "a power of two that divides the slice's 4 devices"),
    (dict(source_tensor=0), "source_tensor"),
    (dict(source_tensor=512), "source_tensor"),
    (dict(source_tensor="4; rm -rf /"), "source_tensor"),
    (dict(source_tensor=2, source_sharding="replicated"), "planned with the state sharded")])
def test_a_tensor_split_the_slice_cannot_hold_is_one_line_naming_the_field(given, says):
    with pytest.raises(ConfigError) as info:
        forms.plan_request(workload="llama", preset="tiny", source="v5p-8", **given)
    text = str(info.value)
    assert text.startswith("source_tensor: ") and says in text and "\n" not in text and len(text) < 400


@pytest.mark.slow
def test_tensor_parallelism_on_the_tpu_side_splits_each_layer_over_the_tensor_axis():
    """The stated TPU job with ici_tensor_parallelism 2 is compiled as MaxText lays it out: FSDP over the
    rest of the slice, each layer's weights split over 2 chips. Where FSDP gathers a layer's weights whole
    on every chip, each chip holds half of them: a layer of weights (117M parameters here, activations
    small) costs about half its bf16 bytes less per chip (measured: 552 MiB against 651 MiB)."""
    d, f = 2048, 16384
    model = {"n_layers": 1, "d_model": d, "n_heads": 16, "n_kv_heads": 16, "d_ff": f, "vocab_size": 1024,
             "seq_len": 128}
    base = dict(workload="llama", preset="8b", model=model, source="tpu-v5p-8", global_batch=8)
    split = compile_for_source_tpu(validate_plan_request(PlanRequest(**base, source_tensor=2)))
    whole = compile_for_source_tpu(validate_plan_request(PlanRequest(**base, source_sharding="fsdp")))
    assert split["status"] == whole["status"] == "ok", (split, whole)
    assert (split["layout"], whole["layout"]) == ("fsdp+tp2", "fsdp")
    half_a_layer = (4 * d * d + 3 * d * f) * 2 / 2  # bf16 bytes of half the layer's weights
    saved = whole["peak_bytes_per_chip"] - split["peak_bytes_per_chip"]
    assert 0.5 * half_a_layer < saved < 1.5 * half_a_layer, (split, whole)
    mlp = compile_for_source_tpu(validate_plan_request(PlanRequest(workload="mlp", preset="tiny", source="tpu-v5p-8",
                                                                   global_batch=32, source_tensor=2)))
    assert mlp["status"] == "failed" and "splits no weight over a tensor axis" in mlp["reason"]


@pytest.mark.slow
def test_expert_parallelism_on_the_tpu_side_keeps_each_chips_experts_whole():
    """A mixture-of-experts job with ici_expert_parallelism 4 on a v5p-8 (4 chips): each chip holds a quarter
    of every MoE layer's experts and never gathers the rest, where FSDP gathers a layer's experts whole on
    every chip; the tokens travel instead. A chip's peak is lower by at least half of three quarters of a
    layer's experts in bf16; a dense model has no experts to split (one line naming source_expert)."""
    d, f, e = 512, 2048, 8
    model = {"dispatch": "capacity", "n_layers": 2, "first_dense": 0, "d_model": d, "expert_d_ff": f,
             "n_experts": e, "n_shared_experts": 0, "vocab_size": 1024, "seq_len": 128}
    base = dict(workload="moe", preset="tiny", model=model, source="tpu-v5p-8", global_batch=8)
    split = compile_for_source_tpu(validate_plan_request(PlanRequest(**base, source_expert=4)))
    whole = compile_for_source_tpu(validate_plan_request(PlanRequest(**base, source_sharding="fsdp")))
    assert split["status"] == whole["status"] == "ok", (split, whole)
    assert (split["layout"], whole["layout"]) == ("fsdp+ep4", "fsdp")
    layer_experts = e * 3 * d * f * 2  # bf16 bytes of one MoE layer's routed experts (gated: up is 2 x f wide)
    saved = whole["peak_bytes_per_chip"] - split["peak_bytes_per_chip"]
    assert saved > 0.5 * 0.75 * layer_experts, (split["peak_bytes_per_chip"], whole["peak_bytes_per_chip"])
    with pytest.raises(ConfigError, match="source_expert: .*llama has no routed experts"):
        validate_plan_request(PlanRequest(workload="llama", preset="tiny", source="tpu-v5p-8", global_batch=8,
                                          source_expert=2))


# -- a TPU answer when the stated setup does not fit ----------------------------------------------------------

def test_the_fitting_ladders_keep_less_or_halve_the_micro_batch_keeping_the_global_batch():
    stated = TpuSetup("replicated", "none", 16, 1)
    ladders = tpu_fit_ladders(stated, get_workload("llama"), TPU_SPECS["tpu-v5e-4"])
    assert ladders.layout == [TpuSetup("fsdp", "none", 16, 1)]  # the state sharded first, where it was replicated
    remats = [s.remat for s in ladders.remat]
    assert remats[0] == "dots_no_batch" and remats[-1] == "custom:decoder_layer_input=offload"
    assert {(s.batch, s.accumulation) for s in ladders.remat} == {(16, 1)}
    assert [(s.remat, s.batch, s.accumulation) for s in ladders.batch] == [
        ("none", 8, 2), ("none", 4, 4), ("none", 2, 8), ("none", 1, 16)]  # the stated policy, smaller batches
    assert {s.remat for s in ladders.fallback} == {remats[-1]}  # where neither fits: halved under the last
    everything = ladders.layout + ladders.remat + ladders.batch + ladders.fallback
    assert all(s.batch * s.accumulation == 16 and s.layout == "fsdp" for s in everything)
    # a model that tags no activations: the whole-block policies only
    mlp = tpu_fit_ladders(TpuSetup("fsdp", "none", 4, 1), get_workload("mlp"), TPU_SPECS["tpu-v5e-4"])
    assert not mlp.layout and {s.remat for s in mlp.remat + mlp.fallback} <= {"dots_no_batch", "full"}


def oom(needs_gib: float) -> RuntimeError:
    return RuntimeError(f"RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
                        f"The total memory required for HLO temporaries ({needs_gib}G) exceeds available HBM (15.75G)")


def test_the_cheapest_fit_is_the_faster_of_the_two_ladders_first_fits_by_the_step_model():
    """A stand-in compiler (the real one is in the slow test below): which setups fit, and each fit's
    predicted step. The cheapest fit is the faster of the first fit of each ladder, whatever the order."""
    ladders = tpu_fit_ladders(TpuSetup("fsdp", "none", 8, 1), get_workload("llama"), TPU_SPECS["tpu-v5e-4"])

    def compiler(fits: dict[tuple[str, int], float]):
        seen = []

        def compile_one(setup):
            seen.append(setup)
            if (setup.remat, setup.batch) not in fits:
                raise oom(20.0)
            return {"predicted_step_s": fits[(setup.remat, setup.batch)]}
        return compile_one, seen

    # keeping less at the stated batch is slower than half the batch at no remat: the batch ladder wins
    one, seen = compiler({("save_dot_except_mlp", 8): 1.3, ("none", 4): 1.1, ("none", 2): 1.2})
    setup, found, tried, other = cheapest_fit(ladders, one)
    assert (setup.remat, setup.batch, setup.accumulation) == ("none", 4, 2) and found["predicted_step_s"] == 1.1
    assert "remat save_dot_except_mlp" in other and "1.3" in other
    assert len(tried) == 1 and "does not fit (needs 20" in tried[0]  # dots_no_batch at 8; (none, 2) never compiled
    assert TpuSetup("fsdp", "none", 2, 4) not in seen
    # and the other way round
    one, _ = compiler({("dots_no_batch", 8): 0.9, ("none", 4): 1.1})
    assert cheapest_fit(ladders, one)[0] == TpuSetup("fsdp", "dots_no_batch", 8, 1)
    # neither ladder fits: halved under the last policy
    one, _ = compiler({(ladders.remat[-1].remat, 2): 2.0})
    setup, _, tried, other = cheapest_fit(ladders, one)
    assert (setup.remat, setup.batch) == (ladders.remat[-1].remat, 2) and other is None
    # a compile that fails for another reason stops the search, saying so
    def broken(setup):
        raise RuntimeError("INTERNAL: Mosaic failed to compile")
    setup, found, tried, _ = cheapest_fit(ladders, broken)
    assert setup is None and tried == [f"{ladders.remat[0].describe()}: does not compile (INTERNAL: Mosaic failed to compile)"]


@pytest.mark.slow
def test_a_stated_tpu_setup_over_hbm_gets_the_cheapest_setup_that_fits_and_the_comparison_uses_it():
    model = {"n_layers": 8, "d_model": 2048, "n_heads": 16, "n_kv_heads": 16, "d_ff": 8192, "vocab_size": 32000,
             "seq_len": 2048}
    req = validate_plan_request(PlanRequest(workload="llama", preset="8b", model=model, source="tpu-v5e-4",
                                            global_batch=4 * 32, target="h100-sxm"))
    src = compile_for_source_tpu(req)
    assert src["status"] == "does-not-fit" and "remat none" in src["stated"], src
    fitted = src["fitted"]  # compiled by libtpu within its usable HBM, below what the stated setup needs
    assert fitted["peak_bytes_per_chip"] < compare.tpu_needs_bytes(src["reason"])
    assert fitted["per_core_batch"] * fitted["accumulation_steps"] == 32  # the same global batch
    assert fitted["remat"] != "none" and fitted["predicted_step_s"] > 0
    assert all("does not fit (needs" in t for t in src["tried"])  # each tried before it, with what it needed
    step, what = compare.tpu_prediction(src)
    assert step == fitted["predicted_step_s"] and "assumed setup" in what
    text = compare.tpu_fit_text(src, TPU_SPECS["tpu-v5e-4"], 32)
    assert fitted["setup"] in text and "product's assumption" in text
    # the user's measured step still wins
    assert compare.trust(2.0, step, 1.0)["use"] == "measured"
    assert compare.tpu_prediction({"status": "ok", "predicted_step_s": 1.5})[0] == 1.5


@pytest.mark.slow
def test_fsdp_across_slices_shards_the_state_over_every_slice():
    model = {"n_layers": 4, "d_model": 1024, "n_heads": 8, "n_kv_heads": 8, "d_ff": 4096, "vocab_size": 32000,
             "seq_len": 128}  # 131M parameters: the state (2.1 GB) outweighs the activations
    base = dict(workload="llama", preset="8b", model=model, source="tpu-v5e-4", source_slices=2, global_batch=32,
                source_sharding="fsdp")
    across = compile_for_source_tpu(validate_plan_request(PlanRequest(**base, source_dcn_fsdp=True)))
    within = compile_for_source_tpu(validate_plan_request(PlanRequest(**base)))
    assert across["status"] == within["status"] == "ok", (across, within)
    assert (across["layout"], within["layout"]) == ("fsdp", "hybrid:4")
    # the state over 8 devices rather than 4: about half the share per device (16 bytes a parameter)
    state = 16 * get_workload("llama").param_count(get_workload("llama").config("8b", model))
    assert within["peak_bytes_per_chip"] - across["peak_bytes_per_chip"] >= 0.5 * (state / 4 - state / 8)


def test_the_splash_kernel_compiles_for_heads_narrower_than_128_lanes():
    """GPT-2's 64-wide heads run Pallas' splash kernel on the TPU (MaxText's), not XLA's attention: the
    product no longer materialises their scores on the TPU side."""
    from migration.planning.source import tpu_model

    req = validate_plan_request(PlanRequest(workload="transformer", preset="gpt2-small", source="tpu-v5p-8"))
    assert tpu_model(req)["attention"] == "splash"
    cfg = RunConfig(workload="transformer", preset="tiny", model={"attention": "splash", "d_model": 256, "n_heads": 4,
                                                                  "seq_len": 128},  # heads of 64
                    per_device_batch=2, devices=4, precision="bf16", sharding="replicated")
    assert _tpu_memory(cfg, "tpu-v5p-8").temp_size_in_bytes > 0
