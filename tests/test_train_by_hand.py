"""How the train step splits its state and its batch, against splits worked out by hand: FSDP shards an
array's largest dimension the device count divides (the last such on a tie) and leaves the rest, or the
whole array, replicated; a tensor-parallel split already there is kept; the batch is split over every mesh
axis but the tensor one; a step's global batch is per-device batch x devices x accumulation. These splits
decide the memory every plan predicts (a sharded dimension is a 1/N share)."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from migration.config.requests import RunConfig
from migration.step.train import TrainProgram, batch_axes, fsdp_axis, fsdp_spec, make_mesh


@pytest.mark.parametrize("shape, devices, spec", [
    ((4096, 11008), 8, P(None, "data")),  # both divide: the larger, 11,008
    ((11008, 4096), 8, P("data", None)),
    ((4096, 4096), 8, P(None, "data")),  # a tie: the last
    ((4096, 4100), 8, P("data", None)),  # 4,100 does not divide by 8: the other
    ((30, 5), 8, P()),  # nothing divides: replicated
    ((4,), 8, P()),  # smaller than the device count
    ((8,), 8, P("data")),  # exactly the device count
    ((), 8, P()),  # a scalar
    ((32, 4096, 11008), 8, P(None, None, "data")),  # a stacked layer axis is never the largest
    ((4096, 11008), 1, P()),  # one device: nothing to split
])
def test_fsdp_shards_the_largest_dimension_the_devices_divide(shape, devices, spec):
    assert fsdp_spec(shape, devices) == spec


def test_fsdp_keeps_a_tensor_parallel_split_and_shards_another_dimension():
    """A [4096, 11008] weight already split on its columns over "tensor": FSDP takes the rows (4,096, the
    largest left) on its own axis; a vector split over "tensor" with nothing left stays as it is."""
    assert fsdp_spec((4096, 11008), 8, "fsdp", taken=P(None, "tensor")) == P("fsdp", "tensor")
    assert fsdp_spec((4096,), 8, "fsdp", taken=P("tensor")) == P("tensor")
    assert fsdp_spec((4096, 11008), 1, "fsdp", taken=P(None, "tensor")) == P(None, "tensor")


@pytest.mark.parametrize("per_device, devices, accumulation, micro, global_batch", [
    (8, 1, 1, 8, 8), (4, 8, 1, 32, 32), (4, 8, 4, 32, 128), (2, 256, 2, 512, 1024),
])
def test_a_steps_global_batch_is_per_device_times_devices_times_accumulation(per_device, devices, accumulation,
                                                                           micro, global_batch):
    program = TrainProgram.from_config(RunConfig(per_device_batch=per_device, devices=devices,
                                                 accumulation_steps=accumulation))
    assert (program.micro_batch, program.global_batch) == (micro, global_batch)


def test_the_batch_splits_over_every_axis_but_the_tensor_one():
    devices = jax.devices()[:8]
    assert len(devices) == 8  # tests/conftest.py: eight CPU devices
    data = make_mesh(devices, "fsdp")
    assert (batch_axes(data), fsdp_axis(data)) == ("data", "data")
    hybrid = make_mesh(devices, "hybrid:4")
    assert batch_axes(hybrid) == ("data", "fsdp") and fsdp_axis(hybrid) == "fsdp"
    assert dict(hybrid.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    tensor = make_mesh(devices, "fsdp+tp2")  # FSDP over 4, tensor parallelism over 2
    assert batch_axes(tensor) == ("data", "fsdp") and dict(tensor.shape) == {"data": 1, "fsdp": 4, "tensor": 2}


def test_a_mesh_is_over_the_devices_given_in_their_order_with_auto_axes():
    """Auto axes (XLA's partitioner places the collectives; JAX's make_mesh defaults to Explicit ones) over
    exactly the devices the caller picked: four of eight for a layout, numbered as given; with no layout
    named, replicated on the one "data" axis."""
    from jax.sharding import AxisType

    four = jax.devices()[2:6]
    for layout in ("replicated", "fsdp"):
        mesh = make_mesh(four, layout)
        assert (mesh.axis_names, mesh.axis_types, list(mesh.devices.flat)) == (("data",), (AxisType.Auto,), four)
    assert make_mesh(four).axis_names == ("data",)
    eight = jax.devices()[::-1]
    mesh = make_mesh(eight, "hybrid:4")
    assert mesh.axis_names == ("data", "fsdp", "tensor") and mesh.axis_types == (AxisType.Auto,) * 3
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1} and list(mesh.devices.flat) == eight
