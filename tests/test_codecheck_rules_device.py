"""The device, topology and shape rules of the code check, pattern by pattern: which source fires which
rule on which line, what the user reads, and the near misses that must stay silent.

TPU001, PMAP001/002/003, REMOVED001/002, PJIT001 (device_rules), TOPO001, BF16OPT001 (topology_rules),
TRACE001 and SHAPE001 (shape_rules)."""

from __future__ import annotations

import textwrap

import pytest

from migration.codecheck import RULES, check_source, check_sources


def findings(src: str, rule: str):
    return [f for f in check_source(textwrap.dedent(src)) if f.rule == rule]


def lines(src: str, rule: str) -> list[int]:
    return [f.line for f in findings(src, rule)]


def only(src: str, rule: str):
    found = findings(src, rule)
    assert len(found) == 1, found
    return found[0]


# TPU001: selecting the TPU -----------------------------------------------------------------------

@pytest.mark.parametrize("src, line", [
    ("import jax\ndevs = jax.devices('tpu')\n", 2),
    ("import jax\ndevs = jax.devices('TPU')\n", 2),
    ("import jax\nn = jax.device_count('tpu')\n", 2),
    ("import jax\nn = jax.local_device_count('tpu')\n", 2),
    ("import jax\ndevs = jax.local_devices('tpu')\n", 2),
    ("import jax\ndevs = jax.local_devices(backend='tpu')\n", 2),
    ("import jax\nf = jax.jit(g, backend='tpu')\n", 2),
    ("import jax\n\nb = jax.lib.xla_bridge.get_backend('tpu')\n", 3),
    # a device query without a platform, or for another platform
    ("import jax\ndevs = jax.devices()\n", None),
    ("import jax\ndevs = jax.devices('gpu')\n", None),
    ("import jax\ndevs = jax.devices(backend='gpu')\n", None),
    ("import jax\ndevs = jax.devices(platform)\n", None),
    ("import jax\ndevs = jax.devices(backend=platform)\n", None),
    # "tpu" as the first argument of a call that is not a device query
    ("import jax\nlog('tpu')\n", None),
    ("import jax\nname = str.lower('tpu')\n", None),
])
def test_tpu_device_queries(src, line):
    assert lines(src, "TPU001") == ([line] if line else [])


def test_tpu_device_query_is_an_error_that_names_the_call():
    f = only("import jax\ndevs = jax.devices('tpu')\n", "TPU001")
    assert f.severity == "error" == RULES["TPU001"].severity
    assert "jax.devices" in f.message and "tpu" in f.message
    assert "fails on a GPU machine" in f.message


@pytest.mark.parametrize("src, line", [
    ("import jax\nif jax.default_backend() == 'tpu':\n    pass\n", 2),
    ("import jax\nif 'tpu' == jax.default_backend():\n    pass\n", 2),
    ("import jax\nif jax.lib.xla_bridge.get_backend().platform == 'tpu':\n    pass\n", 2),
    ("import jax\nif 'TPU' in jax.lib.xla_bridge.get_backend().platform_version:\n    pass\n", 2),
    ("import jax\non_tpu = jax.devices()[0].platform == 'tpu'\n", 2),
    ("import jax\non_tpu = jax.devices()[0].device_kind == 'TPU v4'\n", 2),
    ("import jax\non_tpu = jax.devices()[0].platform in ('tpu',)\n", 2),
    ("import jax\non_tpu = jax.devices()[0].platform in ['tpu', 'TPU']\n", 2),
    ("import jax\non_tpu = jax.devices()[0].platform in {'tpu'}\n", 2),
    # the platform read into a name first
    ("import jax\nbackend = jax.default_backend()\n\nif backend == 'tpu':\n    pass\n", 4),
    ("import jax\nkind = jax.devices()[0].device_kind\nuse_tpu = kind == 'TPU v3'\n", 3),
    ("import jax\nplat, n = jax.default_backend(), 1\nuse_tpu = plat == 'tpu'\n", 3),
    # a comparison with another platform, or a set of platforms that includes a GPU
    ("import jax\nif jax.default_backend() == 'gpu':\n    pass\n", None),
    ("import jax\nok = jax.devices()[0].platform in ('tpu', 'gpu')\n", None),
    ("import jax\nok = jax.devices()[0].platform in ('tpu', 'cuda')\n", None),
    ("import jax\nok = jax.devices()[0].platform in ('tpu', 'rocm')\n", None),
    ("import jax\nok = jax.devices()[0].platform in ('cpu', 'gpu')\n", None),
    ("import jax\nok = jax.devices()[0].platform in ()\n", None),
    ("import jax\nok = jax.devices()[0].platform in [name]\n", None),
    # "tpu" compared with something that is not the platform
    ("import jax\nok = mode == 'tpu'\n", None),
    ("import jax\nok = 'tpu' == 'tpu'\n", None),
    # the platform a user asked for on the command line or in a config is not the machine's
    ("import jax\nif args.platform == 'tpu':\n    pass\n", None),
    ("import jax\nif config.device_kind == 'tpu':\n    pass\n", None),
    ("import jax\nif self.cfg.platform == 'tpu':\n    pass\n", None),
    ("import jax\nif FLAGS.platform == 'tpu':\n    pass\n", None),
])
def test_tpu_platform_comparisons(src, line):
    assert lines(src, "TPU001") == ([line] if line else [])


def test_tpu_platform_comparison_message_says_the_branch_never_runs():
    f = only("import jax\nif jax.default_backend() == 'tpu':\n    pass\n", "TPU001")
    assert f.message.startswith("the code checks for a TPU backend")
    assert f.message.endswith("on a GPU machine the check fails or the TPU branch never runs")


@pytest.mark.parametrize("src, line", [
    ("import jax\nif jax.devices()[0].platform.startswith('tpu'):\n    pass\n", 2),
    ("import jax\nif jax.devices()[0].device_kind.endswith('TPU'):\n    pass\n", 2),
    ("import jax\nif jax.devices()[0].device_kind.startswith(('TPU v4', 'TPU v5')):\n    pass\n", 2),
    ("import jax\nkind = jax.devices()[0].device_kind\nif kind.startswith('TPU'):\n    pass\n", 3),
    # another platform, a prefix that is not literal, a string that is not the platform
    ("import jax\nif jax.devices()[0].platform.startswith('gpu'):\n    pass\n", None),
    ("import jax\nif jax.devices()[0].platform.startswith(prefix):\n    pass\n", None),
    ("import jax\nif jax.devices()[0].platform.startswith():\n    pass\n", None),
    ("import jax\nif name.startswith('tpu'):\n    pass\n", None),
    ("import jax\nif args.platform.startswith('tpu'):\n    pass\n", None),
    ("import jax\nif jax.devices()[0].platform.count('tpu'):\n    pass\n", None),
    ("import jax\nif startswith('tpu'):\n    pass\n", None),
])
def test_tpu_platform_prefix_checks(src, line):
    assert lines(src, "TPU001") == ([line] if line else [])


def test_tpu_prefix_check_message_says_the_code_checks_for_a_tpu_device():
    f = only("import jax\nif jax.devices()[0].platform.startswith('tpu'):\n    pass\n", "TPU001")
    assert f.message.startswith("the code checks for a TPU device")
    assert f.message.endswith("on a GPU machine the check fails or the TPU branch never runs")


@pytest.mark.parametrize("src, line", [
    ("import jax\njax.config.update('jax_platform_name', 'tpu')\n", 2),
    ("import jax\njax.config.update('jax_platforms', 'tpu')\n", 2),
    ("import jax\njax.config.update('jax_platforms', 'TPU,cpu')\n", 2),
    ("import jax\njax.config.update('jax_platforms', 'cpu,tpu')\n", 2),
    ("from jax import config\n\nconfig.update('jax_platforms', 'tpu')\n", 3),
    # GPUs, a platform in a variable, or another setting
    ("import jax\njax.config.update('jax_platforms', 'cuda,cpu')\n", None),
    ("import jax\njax.config.update('jax_platforms', 'tpus')\n", None),
    ("import jax\njax.config.update('jax_platforms', platform)\n", None),
    ("import jax\njax.config.update('jax_platforms')\n", None),
    ("import jax\njax.config.update('jax_default_device', 'tpu')\n", None),
    ("import jax\nsettings.update('jax_platforms', 'tpu')\n", None),
])
def test_tpu_platform_setting(src, line):
    assert lines(src, "TPU001") == ([line] if line else [])


def test_tpu_platform_setting_message_quotes_the_setting_and_value():
    f = only("import jax\njax.config.update('jax_platforms', 'tpu,cpu')\n", "TPU001")
    assert "`jax_platforms` is set to 'tpu,cpu'" in f.message


def test_colab_tpu_setup_call_is_flagged_on_its_line():
    src = "import jax\nimport jax.tools.colab_tpu\n\njax.tools.colab_tpu.setup_tpu()\n"
    f = only(src, "TPU001")
    assert f.line == 4 and "setup_tpu()" in f.message and "Colab" in f.message
    assert lines("import jax\n\nmy.colab_tpu.setup_tpu()\n", "TPU001") == []


# PMAP001: pmap itself ------------------------------------------------------------------------------

@pytest.mark.parametrize("src, line", [
    ("import jax\n\np_step = jax.pmap(step)\n", 3),
    ("import jax\n\n@jax.pmap\ndef step(x):\n    return x\n", 3),
    ("from jax import pmap\n\np_step = pmap(step)\n", 3),
    ("from jax import pmap as pm\n\np_step = pm(step)\n", 3),
    ("p_step = pmap(step)\n", 1),  # a snippet that does not show its imports
    # other transformations, and a pmap of the file's own
    ("import jax\n\nv_step = jax.vmap(step)\n", None),
    ("def pmap(f):\n    return f\n\np_step = pmap(step)\n", None),
    ("class pmap:\n    pass\n\np_step = pmap(step)\n", None),
    ("import mylib\n\np_step = mylib.pmap(step)\n", None),
])
def test_pmap_uses(src, line):
    assert lines(src, "PMAP001") == ([line] if line else [])


def test_pmap_is_a_warning():
    f = only("import jax\np = jax.pmap(f)\n", "PMAP001")
    assert f.severity == "warning"
    assert f.message == "pmap is in maintenance mode; it replicates by hand what jit + sharding does"


# PMAP002: collectives under pmap ---------------------------------------------------------------------

PMAPPED_COLLECTIVE = """\
import jax

@jax.pmap
def step(x):
    return jax.lax.pmean(x, 'batch')
"""

PMAPPED_BY_CALL = """\
import jax
from jax import lax

def step(x):
    return lax.psum(x, 'batch')

p_step = jax.pmap(step)
"""

SHARD_MAP_FILE = """\
import jax
from jax.experimental.shard_map import shard_map

def body(x):
    return jax.lax.psum(x, 'data')

f = shard_map(body, mesh=mesh, in_specs=P('data'), out_specs=P())
"""

PMAPPED_THEN_PLAIN = """\
import jax
from jax.experimental.shard_map import shard_map

@jax.pmap
def old_step(x):
    return jax.lax.pmean(x, 'batch')

def new_body(x):
    return jax.lax.psum(x, 'data')

f = shard_map(new_body, mesh=mesh, in_specs=P('data'), out_specs=P())
"""

NESTED_PMAPPED = """\
import jax
from jax.experimental.shard_map import shard_map

@jax.pmap
def outer(x):
    def inner(y):
        return jax.lax.all_gather(y, 'batch')
    return jax.lax.psum(inner(x), 'batch')

g = shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())
"""


@pytest.mark.parametrize("src, expected", [
    (PMAPPED_COLLECTIVE, [5]),
    (PMAPPED_BY_CALL, [5]),
    # a file that pmaps: its collectives run under pmap even where the function is not seen pmapped
    ("import jax\n\ndef helper(x):\n    return jax.lax.pmean(x, 'i')\n\nf = jax.pmap(g)\n", [4]),
    # shard_map's collectives are the replacement, not a pmap leftover
    (SHARD_MAP_FILE, []),
    (PMAPPED_THEN_PLAIN, [6]),
    (NESTED_PMAPPED, [7, 8]),
    # no pmap in the file at all
    ("import jax\n\ndef f(x):\n    return jax.lax.psum(x, 'i')\n", []),
    # not a collective, or not lax's
    ("import jax\n\n@jax.pmap\ndef step(x):\n    return jax.lax.add(x, x)\n", []),
    ("import jax\n\n@jax.pmap\ndef step(x):\n    return mylib.psum(x)\n", []),
])
def test_collectives_under_pmap(src, expected):
    assert lines(src, "PMAP002") == expected


def test_collective_message_names_the_collective():
    f = only(PMAPPED_COLLECTIVE, "PMAP002")
    assert "`jax.lax.pmean` inside a pmapped function" == f.message


# PMAP003: pmap-era placement helpers ------------------------------------------------------------------

@pytest.mark.parametrize("src, line, helper", [
    ("import flax\n\nstate = flax.jax_utils.replicate(state)\n", 3, "replicate"),
    ("from flax import jax_utils\n\nstate = jax_utils.unreplicate(state)\n", 3, "unreplicate"),
    ("from flax.training.common_utils import shard\n\nbatch = shard(batch)\n", 3, "shard"),
    ("from flax.training import common_utils\nkeys = common_utils.shard_prng_key(key)\n", 2, "shard_prng_key"),
])
def test_placement_helpers(src, line, helper):
    f = only(src, "PMAP003")
    assert f.line == line
    assert f.message.startswith(f"`{helper}` places data by hand for pmap")


def test_placement_helper_message_and_its_own_replacement():
    f = only("import flax\nstate = flax.jax_utils.replicate(state)\n", "PMAP003")
    assert f.message == "`replicate` places data by hand for pmap (a leading device axis, a copy per device)"
    assert f.replacement == "jax.device_put(x, NamedSharding(mesh, P())) (or keep the state sharded)"
    f = only("from flax.training.common_utils import shard\nbatch = shard(batch)\n", "PMAP003")
    assert f.replacement.startswith("jax.device_put(batch, NamedSharding(mesh, P('data')))")
    f = only("from flax import jax_utils\nstate = jax_utils.unreplicate(state)\n", "PMAP003")
    assert f.replacement.startswith("nothing: a replicated or sharded jax.Array is already one array")


@pytest.mark.parametrize("src", [
    "import numpy as np\nx = np.shard(batch)\n",
    "def shard(x):\n    return x\n\nbatch = shard(batch)\n",
    "import jax\nstate = jax.device_put(state, sharding)\n",
])
def test_placement_helpers_near_misses(src):
    assert lines(src, "PMAP003") == []


# REMOVED001 / REMOVED002: APIs removed from JAX and Flax ----------------------------------------------

@pytest.mark.parametrize("src, line", [
    ("import jax.experimental.maps\n", 1),
    ("import os, jax.experimental.maps\n", 1),
    ("from jax.experimental.maps import xmap, Mesh\n", 1),
    ("from jax.experimental import optimizers\n", 1),
    ("import jax\n\nfrom jax.experimental.pjit import with_sharding_constraint\n", 3),
    # what is still there
    ("import jax.experimental\n", None),
    ("from jax.experimental import mesh_utils\n", None),
    ("from jax.sharding import PartitionSpec\n", None),
    ("from . import maps\n", None),
])
def test_removed_imports(src, line):
    assert lines(src, "REMOVED001") == ([line] if line else [])


def test_removed_import_names_the_library_and_the_replacement():
    f = only("from flax import optim\n", "REMOVED001")
    assert f.severity == "error"
    assert f.message == "`flax.optim` is imported: it was removed from Flax"
    assert f.replacement == "optax"
    f = only("from jax.experimental.maps import xmap\n", "REMOVED001")
    assert f.message == "`jax.experimental.maps.xmap` is imported: it was removed from JAX"


@pytest.mark.parametrize("src, line, replacement", [
    ("import jax\n\nout = jax.tree_map(f, tree)\n", 3, "jax.tree.map"),
    ("import jax.numpy as jnp\ny = jnp.product(x)\n", 2, "jax.numpy.prod"),
    ("import jax\ny = jax.lax.tie_in(x, y)\n", 2, "nothing: drop the call (a no-op since 2020)"),
    ("import jax\nk: jax.random.KeyArray = key\n", 2, "jax.Array (keys from jax.random.key)"),
])
def test_removed_names_in_use(src, line, replacement):
    f = only(src, "REMOVED001")
    assert f.line == line and f.replacement == replacement
    assert "was removed from JAX" in f.message


@pytest.mark.parametrize("src", [
    "import jax\nout = jax.tree.map(f, tree)\n",
    "import jax.numpy as jnp\ny = jnp.prod(x)\n",
    "import jax\ny = mylib.tree_map(f, tree)\n",
])
def test_current_names_are_not_removed(src):
    assert lines(src, "REMOVED001") == []


def test_a_removed_module_is_reported_at_its_import_not_at_each_use():
    src = "from jax.experimental import maps\n\nmesh = maps.Mesh(devices, ('x',))\nf = maps.xmap(g)\n"
    assert lines(src, "REMOVED001") == [1]


@pytest.mark.parametrize("src, line", [
    ("import jax\nx = jax.device_put_replicated(x, devices)\n", 2),
    ("import jax\nx = jax.device_put_sharded(shards, devices)\n", 2),
    ("x = device_put_replicated(x, devices)\n", 1),  # a snippet
    ("x = device_put_sharded(shards, devices)\n", 1),
    # the file's own helper of that name, or a method of another object
    ("def device_put_sharded(xs, ds):\n    return xs\n\nx = device_put_sharded(shards, devices)\n", None),
    ("x = placer.device_put_sharded(shards, devices)\n", None),
    ("import jax\nx = jax.device_put(x, sharding)\n", None),
])
def test_removed_device_put_variants(src, line):
    assert lines(src, "REMOVED001") == ([line] if line else [])


def test_removed_device_put_in_a_snippet_says_when_and_what_instead():
    f = only("x = device_put_replicated(x, devices)\n", "REMOVED001")
    assert "removed in JAX 0.10" in f.message and "device_put_replicated" in f.message
    assert f.replacement.startswith("jax.device_put(x, NamedSharding(mesh, P()))")
    f = only("x = device_put_sharded(x, devices)\n", "REMOVED001")
    assert "P('data')" in f.replacement


@pytest.mark.parametrize("src, line, called", [
    ("import jax\n\njax.clear_backends()\n", 3, "jax.clear_backends"),
    ("from jax import clear_backends\nclear_backends()\n", 2, "jax.clear_backends"),
    ("clear_backends()\n", 1, "clear_backends"),
])
def test_clear_backends(src, line, called):
    f = only(src, "REMOVED002")
    assert f.line == line and f.severity == "error"
    assert f.message == f"`{called}` no longer exists"


def test_clear_caches_is_not_clear_backends():
    assert lines("import jax\njax.clear_caches()\n", "REMOVED002") == []


# PJIT001: pjit's removed keywords -------------------------------------------------------------------

@pytest.mark.parametrize("src, line", [
    ("from jax.experimental.pjit import pjit\n\nf = pjit(g, in_axis_resources=P('x'))\n", 3),
    ("import jax\nf = jax.experimental.pjit.pjit(g, out_axis_resources=P())\n", 2),
    ("import jax\nf = jax.jit(g, in_axis_resources=P('x'))\n", 2),
    ("import functools\nimport jax\nf = functools.partial(jax.jit, out_axis_resources=P())\n", 3),
    ("from functools import partial\nfrom jax.experimental.pjit import pjit\nf = partial(pjit, in_axis_resources=s)\n", 3),
    ("f = pjit(g, in_axis_resources=P('x'))\n", 1),  # a snippet
    ("import jax\nf = partial(jax.jit, in_axis_resources=P('x'))\n", 2),
    # the current keywords, another library's jit, or another transformation
    ("import jax\nf = jax.jit(g, in_shardings=P('x'), out_shardings=P())\n", None),
    ("import numba\nf = numba.jit(g, in_axis_resources=P('x'))\n", None),
    ("import jax\nf = jax.vmap(g, in_axis_resources=P('x'))\n", None),
    ("import functools\nf = functools.partial(helper, in_axis_resources=P())\n", None),
    ("import functools\nf = functools.partial(in_axis_resources=P())\n", None),
    ("def pjit(g, **kw):\n    return g\n\nf = pjit(g, in_axis_resources=P('x'))\n", None),
    ("import jax\nf = jax.pjit_helpers.run(g, in_axis_resources=P('x'))\n", None),
])
def test_pjit_removed_keywords(src, line):
    assert lines(src, "PJIT001") == ([line] if line else [])


def test_pjit_with_both_removed_keywords_is_one_finding_naming_both():
    src = "from jax.experimental.pjit import pjit\nf = pjit(g, in_axis_resources=a, out_axis_resources=b)\n"
    f = only(src, "PJIT001")
    assert f.severity == "error"
    assert f.message == "`in_axis_resources=` and `out_axis_resources=` removed from pjit: the call raises a TypeError"
    assert f.replacement == "in_shardings= and out_shardings= (and jax.jit in place of pjit)"


# TOPO001: a TPU slice's shape written as numbers ----------------------------------------------------

@pytest.mark.parametrize("src, line", [
    ("from jax.experimental import mesh_utils\n\nd = mesh_utils.create_device_mesh((4, 2))\n", 3),
    ("from jax.experimental import mesh_utils\nd = mesh_utils.create_device_mesh([2, 2, 2])\n", 2),
    ("from jax.experimental import mesh_utils\nd = mesh_utils.create_hybrid_device_mesh((4, 2), (2, 1))\n", 2),
    ("import jax\nmesh = jax.make_mesh((1, 8), ('data', 'model'))\n", 2),
    ("import jax\nmesh = jax.make_mesh((2, 1), ('data', 'model'))\n", 2),
    # one device (tests), one axis, or a shape computed at run time
    ("import jax\nmesh = jax.make_mesh((1, 1), ('data', 'model'))\n", None),
    ("import jax\nmesh = jax.make_mesh((8,), ('data',))\n", None),
    ("import jax\nmesh = jax.make_mesh((n, 2), ('data', 'model'))\n", None),
    ("import jax\nmesh = jax.make_mesh((-1, 2), ('data', 'model'))\n", None),
    ("import jax\nmesh = jax.make_mesh((0, 2), ('data', 'model'))\n", None),
    ("import jax\nmesh = jax.make_mesh((True, 2), ('data', 'model'))\n", None),
    ("import jax\nmesh = jax.make_mesh((2.0, 4.0), ('data', 'model'))\n", None),
    ("import jax\nmesh = jax.make_mesh(shape, ('data', 'model'))\n", None),
    ("import jax\nmesh = jax.make_mesh()\n", None),
    ("import jax\nmesh = build_mesh((4, 2))\n", None),
])
def test_mesh_shapes(src, line):
    assert lines(src, "TOPO001") == ([line] if line else [])


def test_mesh_shape_message_gives_the_shape_and_device_count():
    f = only("import jax\nmesh = jax.make_mesh((4, 2), ('data', 'model'))\n", "TOPO001")
    assert f.severity == "warning"
    assert f.message == "`make_mesh((4, 2))` fixes the mesh to 8 devices"
    f = only("import jax\nmesh = jax.make_mesh((2, 3, 4), ('a', 'b', 'c'))\n", "TOPO001")
    assert "to 24 devices" in f.message


@pytest.mark.parametrize("src, line", [
    ("import jax\nimport numpy as np\n\ndevs = np.array(jax.devices()).reshape(4, 2)\n", 4),
    ("import jax\nimport numpy as np\ndevs = np.array(jax.devices()).reshape((2, 4))\n", 3),
    ("import jax\nimport numpy as np\ndevs = np.asarray(jax.local_devices()).reshape([8])\n", 3),
    ("import jax\nimport numpy as np\ndevs = np.array(jax.devices()).reshape(8)\n", 3),
    ("import jax\nimport numpy as np\ndevs = np.array(jax.devices()).reshape(1, 2)\n", 3),
    # the size read from the devices, one device, or not the device list
    ("import jax\nimport numpy as np\ndevs = np.array(jax.devices()).reshape(-1, 2)\n", None),
    ("import jax\nimport numpy as np\ndevs = np.array(jax.devices()).reshape(n, 2)\n", None),
    ("import jax\nimport numpy as np\ndevs = np.array(jax.devices()).reshape(1)\n", None),
    ("import jax\nimport numpy as np\ndevs = np.array(jax.devices()).reshape(1, 1)\n", None),
    ("import jax\nimport numpy as np\ndevs = np.array(jax.devices()).reshape()\n", None),
    ("import jax\nimport numpy as np\nx = np.zeros(8).reshape(4, 2)\n", None),
    ("import jax\nimport numpy as np\nx = np.reshape(jax.devices(), (4, 2))\n", None),
    ("import jax\nimport numpy as np\nx = reshape(jax.devices(), (4, 2))\n", None),
])
def test_device_list_reshapes(src, line):
    assert lines(src, "TOPO001") == ([line] if line else [])


def test_device_list_reshape_message():
    f = only("import jax\nimport numpy as np\nd = np.array(jax.devices()).reshape(4, 2)\n", "TOPO001")
    assert f.message.startswith("the device list is reshaped to (4, 2): 8 devices")


@pytest.mark.parametrize("src, line", [
    ("import jax\n\nassert jax.device_count() == 8\n", 3),
    ("import jax\nassert 8 == jax.local_device_count()\n", 2),
    ("import jax\nassert len(jax.devices()) == 32\n", 2),
    ("import jax\nassert len(jax.local_devices()) >= 4\n", 2),
    ("import jax\nassert cores_per_replica <= 8\n", 2),
    ("import jax\nif num_tpus == 32:\n    pass\n", 2),
    ("import jax\nif self.num_cores == 2:\n    pass\n", 2),
    ("import jax\nif n_chips != 4:\n    pass\n", 2),
    # one device is not a slice's layout; a count from somewhere else is fine
    ("import jax\nassert jax.device_count() == 1\n", None),
    ("import jax\nassert jax.device_count() >= 1\n", None),
    ("import jax\nassert jax.device_count() == n\n", None),
    ("import jax\nassert jax.device_count() % 8 == 0\n", None),
    ("import jax\nassert jax.device_count() in (8, 16)\n", None),
    ("import jax\nassert len(batch) == 8\n", None),
    ("import jax\nassert len() == 8\n", None),
    ("import jax\nassert num_layers == 8\n", None),
    ("import jax\nassert model.core.num_heads == 8\n", None),
    ("import jax\nassert n == 8\n", None),
    ("import jax\nassert cores_per_replica <= limit\n", None),
    ("import jax\nassert process_count() == 8\n", None),
])
def test_device_count_comparisons(src, line):
    assert lines(src, "TOPO001") == ([line] if line else [])


@pytest.mark.parametrize("comparison, count", [("jax.device_count() == 8", 8), ("1 < jax.device_count() == 16", 16)])
def test_device_count_message_gives_the_number(comparison, count):
    source = "import jax\nassert " + comparison + "\n"
    assert only(source, "TOPO001").message == f"the code expects {count} devices (or cores) by number"


# BF16OPT001: optimizer state in 16 bits --------------------------------------------------------------

@pytest.mark.parametrize("src, line", [
    ("import optax\nimport jax.numpy as jnp\n\ntx = optax.adam(1e-3, mu_dtype=jnp.bfloat16)\n", 4),
    ("import optax\ntx = optax.adamw(1e-3, mu_dtype='bfloat16')\n", 2),
    ("import optax\nimport jax\ntx = optax.adam(1e-3, mu_dtype=jax.numpy.bfloat16)\n", 3),
    ("import optax\nimport jax.numpy as jnp\ntx = optax.adam(1e-3, nu_dtype=jnp.float16)\n", 3),
    ("import optax\nimport numpy as np\ntx = optax.sgd(0.1, momentum=0.9, accumulator_dtype=np.half)\n", 3),
    ("import optax\nimport jax.numpy as jnp\ntx = make_opt(momentum_dtype=jnp.bfloat16)\n", 3),
    ("import optax\nimport jax.numpy as jnp\ntx = make_opt(dtype_momentum=jnp.bfloat16)\n", 3),
    # full precision, no dtype, or a 16-bit dtype that is not optimizer state
    ("import optax\nimport jax.numpy as jnp\ntx = optax.adam(1e-3, mu_dtype=jnp.float32)\n", None),
    ("import optax\ntx = optax.adam(1e-3, mu_dtype=None)\n", None),
    ("import optax\ntx = optax.adam(1e-3, mu_dtype=dtype)\n", None),
    ("import jax.numpy as jnp\nx = jnp.zeros(3, dtype=jnp.bfloat16)\n", None),
])
def test_optimizer_state_dtype(src, line):
    assert lines(src, "BF16OPT001") == ([line] if line else [])


def test_optimizer_state_dtype_message_quotes_the_keyword():
    f = only("import optax\nimport jax.numpy as jnp\ntx = optax.adam(1e-3, mu_dtype=jnp.bfloat16)\n", "BF16OPT001")
    assert f.severity == "warning"
    assert f.message == "`mu_dtype=jnp.bfloat16` keeps optimizer state in 16 bits"
    f = only("import optax\ntx = optax.adam(1e-3, mu_dtype='bfloat16')\n", "BF16OPT001")
    assert f.message.startswith("`mu_dtype=bfloat16` keeps")


@pytest.mark.parametrize("src, line", [
    ("import jax\nimport jax.numpy as jnp\n\n"
     "grad_acc = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.bfloat16), params)\n", 4),
    ("import jax\nimport jax.numpy as jnp\ngrads_accum = jax.tree.map(lambda g: g.astype(jnp.float16), grads)\n", 3),
    ("import jax\nself.accumulator = jax.tree.map(lambda g: g.astype('bfloat16'), grads)\n", 2),
    ("import jax\nimport jax.numpy as jnp\nacc: dict = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.half), p)\n",
     3),
    ("import jax\nimport jax.numpy as jnp\nstep, acc = 0, jnp.zeros(3, dtype=jnp.bfloat16)\n", 3),
    # 32 bits, no accumulator, or no value
    ("import jax\nimport jax.numpy as jnp\ngrad_acc = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), p)\n",
     None),
    ("import jax\nimport jax.numpy as jnp\ngrad_acc = jax.tree.map(lambda g: g.astype(jnp.float32), grads)\n", None),
    ("import jax\nimport jax.numpy as jnp\ngrad_acc = jax.tree.map(lambda g: g.astype(), grads)\n", None),
    ("import jax\nimport jax.numpy as jnp\nparams = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)\n", None),
    ("import jax\nimport jax.numpy as jnp\naccuracy = jnp.mean(x.astype(jnp.bfloat16))\n", None),
    ("import jax\nimport jax.numpy as jnp\ngrad_acc = jnp.zeros(3, other=jnp.bfloat16)\n", None),
    ("import jax\nacc: dict\n", None),
    # the assigned attribute's own name decides, not the object it is set on
    ("import jax\nimport jax.numpy as jnp\nself.accum.params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), p)\n",
     None),
])
def test_gradient_accumulators_in_16_bits(src, line):
    assert lines(src, "BF16OPT001") == ([line] if line else [])


def test_gradient_accumulator_message_names_the_variable():
    src = "import jax\nimport jax.numpy as jnp\ngrad_acc = jax.tree.map(lambda g: g.astype(jnp.bfloat16), g)\n"
    assert only(src, "BF16OPT001").message == "`grad_acc` accumulates gradients in 16 bits"


# SHAPE001: batch shapes that vary between steps ------------------------------------------------------

@pytest.mark.parametrize("src, line", [
    ("import tensorflow as tf\n\nds = ds.batch(32)\n", 3),
    ("import tensorflow as tf\nds = ds.padded_batch(32)\n", 2),
    ("import tensorflow as tf\nds = ds.batch(32, drop_remainder=False)\n", 2),
    ("import tensorflow as tf\nds = ds.shuffle(100).batch(32).prefetch(2)\n", 2),
    # the last batch dropped, or a choice made elsewhere
    ("import tensorflow as tf\nds = ds.batch(32, drop_remainder=True)\n", None),
    ("import tensorflow as tf\nds = ds.batch(32, drop_remainder=drop)\n", None),
    ("import tensorflow as tf\nds = ds.padded_batch(32, drop_remainder=True)\n", None),
    ("import tensorflow as tf\nds = batch(ds, 32)\n", None),
    ("import tensorflow as tf\nds = ds.unbatch()\n", None),
])
def test_dataset_batches(src, line):
    assert lines(src, "SHAPE001") == ([line] if line else [])


def test_dataset_batch_message():
    f = only("import tensorflow as tf\nds = ds.padded_batch(32)\n", "SHAPE001")
    assert f.severity == "warning"
    assert f.message == "`.padded_batch(...)` without drop_remainder=True yields a smaller last batch"


@pytest.mark.parametrize("src, line", [
    ("import torch\n\nloader = torch.utils.data.DataLoader(ds, batch_size=32)\n", 3),
    ("from torch.utils.data import DataLoader\nloader = DataLoader(ds, batch_size=32, drop_last=False)\n", 2),
    ("loader = DataLoader(ds, batch_size=32)\n", 1),  # a snippet
    ("import torch\nloader = torch.utils.data.DataLoader(ds, batch_size=batch)\n", 2),
    # the last batch dropped, batching done by a sampler, or no batching at all
    ("import torch\nloader = torch.utils.data.DataLoader(ds, batch_size=32, drop_last=True)\n", None),
    ("import torch\nloader = torch.utils.data.DataLoader(ds, batch_sampler=sampler)\n", None),
    ("import torch\nloader = torch.utils.data.DataLoader(ds, batch_size=None)\n", None),
    ("import torch\nloader = torch.utils.data.DataLoader(ds, batch_size=32, drop_last=flag)\n", None),
    # another library's DataLoader
    ("import grain.python as grain\nloader = grain.DataLoader(data_source=src, sampler=s)\n", None),
    ("from grain.python import DataLoader\nloader = DataLoader(data_source=src, sampler=s)\n", None),
    ("import torch\nloader = torch.utils.data.Dataset(ds)\n", None),
    # the file's own DataLoader class
    ("class DataLoader:\n    pass\n\nloader = DataLoader(ds, batch_size=32)\n", None),
])
def test_torch_data_loaders(src, line):
    assert lines(src, "SHAPE001") == ([line] if line else [])


def test_data_loader_message():
    f = only("import torch\nloader = torch.utils.data.DataLoader(ds, batch_size=32)\n", "SHAPE001")
    assert f.message == "`DataLoader(...)` without drop_last=True yields a smaller last batch"


# TRACE001: Python control flow on a traced value ---------------------------------------------------

JIT_IF = """\
import jax

@jax.jit
def f(x):
    if x > 0:
        return x
    return -x
"""


@pytest.mark.parametrize("src, expected", [
    (JIT_IF, [5]),
    # each statement that branches on the value
    ("import jax\n\n@jax.jit\ndef f(x):\n    while x > 0:\n        x = x - 1\n    return x\n", [5]),
    ("import jax\n\n@jax.jit\ndef f(x):\n    return x if x > 0 else -x\n", [5]),
    ("import jax\n\n@jax.jit\ndef f(x):\n    assert x > 0\n    return x\n", [5]),
    ("import jax\n\n@jax.jit\ndef f(x, n):\n    for _ in range(n):\n        x = x + 1\n    return x\n", [5]),
    ("import jax\n\n@jax.jit\ndef f(x, n):\n    for _ in range(1, n, 2):\n        x = x + 1\n    return x\n", [5]),
    # the same function not transformed, or branching on what is static
    ("import jax\n\ndef f(x):\n    if x > 0:\n        return x\n    return -x\n", []),
    ("import jax\n\n@jax.jit\ndef f(x):\n    if x.shape[0] > 1:\n        return x\n    return -x\n", []),
    ("import jax\n\n@jax.jit\ndef f(x):\n    if x.ndim == 2:\n        return x\n    return -x\n", []),
    ("import jax\n\n@jax.jit\ndef f(x):\n    for i in range(10):\n        x = x + i\n    return x\n", []),
    ("import jax\n\n@jax.jit\ndef f(x, n):\n    for v in x:\n        pass\n    return x\n", []),
    ("import jax\n\n@jax.jit\ndef f(x, n):\n    for i in list(n):\n        pass\n    return x\n", []),
    ("import jax\nfrom functools import partial\n\n@partial(jax.jit, static_argnames='n')\ndef f(x, n):\n"
     "    if n > 0:\n        return x\n    return -x\n", []),
    ("import jax\n\nif x > 0:\n    pass\n", []),
])
def test_branches_on_traced_values(src, expected):
    assert lines(src, "TRACE001") == expected


def test_traced_branch_message_names_the_keyword_and_the_value():
    f = only(JIT_IF, "TRACE001")
    assert f.message == ("`if` on `x`, a traced value inside a transformed function: it raises a "
                         "ConcretizationTypeError (or silently specialises) under jit")
    f = only("import jax\n\n@jax.jit\ndef f(x, n):\n    for _ in range(n):\n        pass\n", "TRACE001")
    assert f.message.startswith("`for ... in range` on `n`")


COMPUTED_CHAIN = """\
import jax

@jax.jit
def f(x):
    a = x * 2
    b = a + 1
    c = b - 3
    if c > 0:
        return c
    return x
"""

BACKWARD_CHAIN = """\
import jax

@jax.jit
def f(x):
    for _ in range(3):
        if d > 0:
            pass
        d = c
        c = b
        b = a
        a = x
    return x
"""

LOOP_TARGET = """\
import jax

@jax.jit
def f(xs):
    for v in xs:
        if v > 0:
            return v
    return xs
"""

REASSIGNED_STATIC = """\
import jax

@jax.jit
def f(x):
    n = 3
    if n > 0:
        return x
    return x
"""

INNER_FUNCTION = """\
import jax

@jax.jit
def f(x, y):
    def g(x):
        if x > 0:
            return x
        if y > 0:
            return y
        return 0
    return g(1)
"""

AFTER_TRANSFORMED = """\
import jax

@jax.jit
def f(x):
    return x

def g(x):
    if x > 0:
        return x
    return -x
"""

BY_CALL = """\
import jax

def f(x, n):
    if x > 0:
        return x
    if n > 0:
        return x
    return -x

g = jax.jit(f, static_argnums=(1,))
"""


@pytest.mark.parametrize("src, expected", [
    (COMPUTED_CHAIN, [8]),
    (BACKWARD_CHAIN, [6]),
    (LOOP_TARGET, [6]),
    (REASSIGNED_STATIC, []),
    # a nested function sees its outer function's traced values, not those its own parameters shadow
    (INNER_FUNCTION, [8]),
    (AFTER_TRANSFORMED, []),
    (BY_CALL, [4]),
])
def test_traced_values_flow_through_the_function(src, expected):
    assert lines(src, "TRACE001") == expected


# the rules over several files, and the order of findings ---------------------------------------------

def test_findings_of_several_files_keep_their_file_and_line():
    check = check_sources([
        ("a.py", "import jax\nassert jax.device_count() == 8\n"),
        ("b.py", "import jax\n\ndevs = jax.devices('tpu')\n"),
    ])
    assert [(f.file, f.line, f.rule) for f in check.findings] == [("a.py", 2, "TOPO001"), ("b.py", 3, "TPU001")]


def test_one_line_with_several_problems_reports_each_rule():
    src = "import jax\np = jax.pmap(step, backend='tpu')\n"
    assert sorted(f.rule for f in check_source(src) if f.line == 2) == ["PMAP001", "TPU001"]
