"""How the user's code runs the layers (`layer_loop`): one scan over the stacked layers, or a Python
loop over them (a model that loops over its blocks; Paxml's USE_REPEATED_LAYER=False). Both compute
the same losses from the same state layout; their compiled programs differ where the step time does
(no loop, no stacked buffer of each layer's saved activations); the form's field fills the model's
settings and refuses what it does not allow."""

import jax
import numpy as np
import pytest

from migration.common import ConfigError, model_name
from migration.config import forms
from migration.config.requests import RunConfig


def test_unrolled_layers_compute_the_scanned_losses_from_the_same_state(trainer):
    base = RunConfig(workload="llama", preset="tiny", per_device_batch=2, devices=1, precision="fp32",
                     learning_rate=3e-3)
    scanned = trainer(base)
    reference = np.array([m["loss"] for m in scanned.run(4)])
    unrolled = trainer(RunConfig(**{**base.to_dict(), "model": {"layer_loop": "unrolled"}}))
    losses = np.array([m["loss"] for m in unrolled.run(4)])
    np.testing.assert_allclose(losses, reference, rtol=1e-4)
    assert reference[-1] < reference[0], "the loss falls: the comparison is of a model that learns"
    # One state layout (stacked layers) for both: a checkpoint of either restores into the other.
    assert [x.shape for x in jax.tree.leaves(unrolled.state.params)] == \
        [x.shape for x in jax.tree.leaves(scanned.state.params)]


def _program_text(layer_loop: str) -> str:
    from jax.experimental import topologies

    from migration.hardware import GPU_SPECS, gpu_target_config
    from migration.step.train import TrainProgram, abstract_batch, abstract_state, jit_step, make_mesh

    model = {"seq_len": 1024, "attention": "xla", "layer_loop": layer_loop}
    cfg = RunConfig(workload="transformer", preset="tiny", model=model, per_device_batch=2, devices=1,
                    precision="bf16", remat="none")
    topo = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(GPU_SPECS["h100-sxm"]),
                                        topology="1x1x1")
    program = TrainProgram.from_config(cfg)
    mesh = make_mesh(topo.devices, program.sharding)
    return jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile().as_text()


def test_the_compiled_programs_differ_where_the_step_time_does():
    """XLA's attention at 1,024 tokens: scanned, each layer's scores are saved into the loop's stacked
    buffer and read back in the backward loop; unrolled, there is no loop and no such copy, and the
    predicted step is shorter (the published 126M Paxml runs, unrolled, are predicted within 21%)."""
    from migration.hardware import GPU_SPECS, Links
    from migration.planning import steptime
    from migration.planning.hlo_cost import read_program

    texts = {loop: _program_text(loop) for loop in ("scan", "unrolled")}
    assert " while(" in texts["scan"] and " while(" not in texts["unrolled"].split("ENTRY")[1]
    spec = GPU_SPECS["h100-sxm"]
    seconds = {loop: steptime.predict(read_program(text), spec, Links.of(spec.key, 1))
               for loop, text in texts.items()}
    assert seconds["unrolled"].flops == pytest.approx(seconds["scan"].flops, rel=0.05)  # the same work
    assert seconds["unrolled"].memory_s < seconds["scan"].memory_s


def test_the_field_fills_the_model_and_refuses_what_it_does_not_allow():
    assert forms.plan_request(workload="llama", preset="tiny", layer_loop="unrolled").model == {
        "layer_loop": "unrolled"}
    assert "layer_loop" not in forms.plan_request(workload="llama", preset="tiny", layer_loop="scan").model
    with pytest.raises(ConfigError, match="layer_loop: must be one of scan, unrolled"):
        forms.plan_request(workload="llama", preset="tiny", layer_loop="while")
    with pytest.raises(ConfigError, match="layer_loop: not a dimension of mlp"):
        forms.plan_request(workload="mlp", layer_loop="unrolled")
    # How the code runs a preset does not make it another model.
    assert model_name("llama", "8b", {"layer_loop": "unrolled"}) == "llama/8b (layer_loop=unrolled)"
