"""The settings, cloud and environment rules of the code check: BATCH001 (TPU-sized batches),
FP16001 (float16 without loss scaling), PREC001 (matmul precision left to the platform), GCS001
(Cloud Storage), TPUENV001 (TPU-only environment variables), ENV001 and TPU001 (JAX environment
set late, or selecting the TPU), and the environment settings a check reports. Each table row is a
source, the rule, and the line it must be found on (None: that rule must not fire)."""

import pytest

from migration.codecheck import RULES, check_source, check_sources


def found(src: str, rule: str) -> list:
    return [f for f in check_source(src) if f.rule == rule]


def assert_lines(src: str, rule: str, line: int | None) -> None:
    lines = [f.line for f in found(src, rule)]
    assert lines == ([] if line is None else [line]), (rule, src)


J = "import jax\nimport jax.numpy as jnp\n"  # a JAX file: line 3 is the first line of a snippet after it


# BATCH001 ------------------------------------------------------------------------------------

BATCH_CASES = [
    # assignments, by name and by size (512 is the smallest TPU-sized batch)
    ("BATCH_SIZE = 4096\n", 1),
    ("batch_size = 512\n", 1),
    ("batch_size = 511\n", None),
    ("global_batch = 4 * 1024\n", 1),
    ("x = 1\nper_device_batch = 1 << 10\n", 2),
    ("bs = 2048\n", 1),
    ("bsz = 1024\n", 1),
    ("a = batch_size = 1024\n", 1),
    ("self.batch_size = 1024\n", 1),
    ("batch_size: int = 1024\n", 1),
    ("self.batch_size: int = 1024\n", 1),
    ("batch_size: int\n", None),
    ("batch_size = (\n    1024\n)\n", 1),
    # counts, bounds, amounts per batch, and other sizes are not batch sizes
    ("NUM_BATCHES = 4096\n", None),
    ("batch_idx = 1024\n", None),
    ("max_batch_size = 4096\n", None),
    ("tokens_per_batch = 4096\n", None),
    ("hidden_size = 4096\n", None),
    ("batch_size = 1024.0\n", None),
    ("batch_size = '1024'\n", None),
    ("batch_size = True\n", None),
    ("batch_size = n * 1024\n", None),
    ("bs, lr = 1024, 0.1\n", None),
    # dict entries: found on the value's line
    ("config = {\n    'lr': 0.1,\n    'batch_size': 1024,\n}\n", 3),
    ("config = {'batch_size': 256, 'eval_steps': 1024}\n", None),
    ("config = {**base, 'batch_size': 2048}\n", 1),
    ("config = {1024: 'batch_size'}\n", None),
    # keyword arguments of any call, on the value's line
    ("train(\n    model,\n    batch_size=1024,\n)\n", 3),
    ("cfg = dict(batch_size=4096)\n", 1),
    ("train(model, steps=1024)\n", None),
    ("print('setting', 'batch_size', 4096)\n", None),
    ("log.info('%s=%d', 'batch_size', 4096)\n", None),
    # argparse defaults, named by the flag without its dashes
    ("p.add_argument('--batch_size', type=int, default=1024)\n", 1),
    ("p.add_argument(\n    '--batch-size',\n    default=2048,\n)\n", 1),
    ("p.add_argument('--batch_size', type=int)\n", None),
    ("p.add_argument('--batch_size', default=64)\n", None),
    ("p.add_argument('--num_batches', default=4096)\n", None),
    ("p.add_argument('--batch_size', default=1024, help='per step')\n", 1),
    # absl flags and configuration lookups with a default
    ("flags.DEFINE_integer('batch_size', 1024, 'global batch')\n", 1),
    ("flags.DEFINE_integer('eval_every', 1024, 'steps')\n", None),
    ("flags.DEFINE_integer('batch_size', 64, 'global batch')\n", None),
    ("b = cfg.get('batch_size', 1024)\n", 1),
    ("b = cfg.get('batch_size')\n", None),
    ("b = cfg.get('batch_size', 128)\n", None),
    ("b = cfg.get(key, 1024)\n", None),
    ("b = cfg.pop('batch_size', 1024)\n", None),
    # getattr with a default: the attribute's name is the second argument
    ("b = getattr(cfg, 'batch_size', 4096)\n", 1),
    ("b = getattr(\n    cfg,\n    'global_batch',\n    1024,\n)\n", 1),
    ("b = getattr(cfg, 'batch_size', 64)\n", None),
    ("b = getattr(cfg, 'num_batches', 4096)\n", None),
    ("b = getattr(cfg, 'batch_size')\n", None),
    ("b = getattr(cfg, name, 4096)\n", None),
    # function defaults: positional, positional-only, keyword-only, async
    ("def train(model, batch_size=1024, lr=0.1):\n    pass\n", 1),
    ("def train(\n    model,\n    batch_size=1024,\n):\n    pass\n", 3),
    ("def train(batch_size=1024, /):\n    pass\n", 1),
    ("def train(batch_size, steps=1024):\n    pass\n", None),
    ("def train(a, b, batch_size, lr=0.1, steps=1024):\n    pass\n", None),
    ("def train(*, batch_size=1024):\n    pass\n", 1),
    ("def train(*, batch_size, steps=1024):\n    pass\n", None),
    ("def train(*, steps=1024, batch_size):\n    pass\n", None),
    ("def train(*, model, batch_size=4096):\n    pass\n", 1),
    ("async def train(batch_size=1024):\n    pass\n", 1),
]


@pytest.mark.parametrize("src,line", BATCH_CASES)
def test_tpu_sized_batches_are_found_where_they_are_written(src, line):
    assert_lines(src, "BATCH001", line)


def test_a_batch_finding_names_the_setting_and_its_size_as_a_warning():
    [f] = found("GLOBAL_BATCH_SIZE = 8 * 512\n", "BATCH001")
    assert "`GLOBAL_BATCH_SIZE = 4096`" in f.message
    assert f.severity == "warning" == RULES["BATCH001"].severity
    [f] = found("p.add_argument('--batch-size', default=2048)\n", "BATCH001")
    assert "`batch-size = 2048`" in f.message
    [f] = found("flags.DEFINE_integer('batch_size', 1024, 'global batch')\n", "BATCH001")
    assert "`batch_size = 1024`" in f.message


def test_a_keyword_batch_is_found_at_the_value_not_at_the_call():
    [f] = found("train(model, batch_size=1024)\n", "BATCH001")
    assert (f.line, f.col) == (1, 25)


def test_each_batch_setting_of_a_file_is_found_once():
    src = ("BATCH_SIZE = 1024\n"
           "cfg = {'batch_size': 2048}\n"
           "p.add_argument('--batch_size', default=4096)\n"
           "def train(batch_size=512):\n    pass\n")
    assert [f.line for f in found(src, "BATCH001")] == [1, 2, 3, 4]


# PREC001 -------------------------------------------------------------------------------------

PREC_CASES = [
    # the default set through the config
    (J + "jax.config.update('jax_default_matmul_precision', 'bfloat16')\n", 3),
    (J + "jax.config.update('jax_default_matmul_precision', 'fastest')\n", 3),
    (J + "jax.config.update(\n    'jax_default_matmul_precision',\n    'DEFAULT',\n)\n", 3),
    ("from jax import config\nconfig.update('jax_default_matmul_precision', 'bfloat16')\n", 2),
    (J + "jax.config.update('jax_default_matmul_precision', 'float32')\n", None),
    (J + "jax.config.update('jax_default_matmul_precision', 'highest')\n", None),
    (J + "jax.config.update('jax_default_matmul_precision')\n", None),
    (J + "jax.config.update('jax_enable_x64', 'default')\n", None),
    (J + "settings.update('jax_default_matmul_precision', 'bfloat16')\n", None),
    # the context manager called on its own does nothing; inside `with` it is what it should be
    (J + "jax.default_matmul_precision('float32')\n", 3),
    (J + "with jax.default_matmul_precision('float32'):\n    y = x @ w\n", None),
    (J + "ctx = jax.default_matmul_precision('float32')\n", None),
    # precision= arguments that ask for the platform default, found on the value's line
    (J + "y = jnp.dot(x, w, precision='bfloat16')\n", 3),
    (J + "y = jnp.dot(\n    x, w,\n    precision='fastest',\n)\n", 5),
    (J + "y = jnp.dot(x, w, precision=jax.lax.Precision.DEFAULT)\n", 3),
    (J + "from jax.lax import Precision\ny = jnp.dot(x, w, precision=Precision.DEFAULT)\n", 4),
    (J + "y = jnp.dot(x, w, precision=jax.lax.Precision('bfloat16'))\n", 3),
    (J + "y = jnp.dot(x, w, precision=(jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT))\n", 3),
    (J + "y = jnp.dot(x, w, precision=['highest', 'default'])\n", 3),
    (J + "y = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)\n", None),
    (J + "y = jnp.dot(x, w, precision=jax.lax.Precision('highest'))\n", None),
    (J + "y = jnp.dot(x, w, precision=jax.lax.Precision())\n", None),
    (J + "y = jnp.dot(x, w, precision=('highest', 'highest'))\n", None),
    (J + "y = jnp.dot(x, w, precision='float32')\n", None),
    (J + "y = jnp.dot(x, w, precision=None)\n", None),
    (J + "y = jnp.dot(x, w, precision=Mode.DEFAULT)\n", None),
    (J + "y = jnp.dot(x, w, precision=make('bfloat16'))\n", None),
    (J + "y = jnp.dot(x, w, preferred_element_type='bfloat16')\n", None),
]


@pytest.mark.parametrize("src,line", PREC_CASES)
def test_matmul_precision_left_to_the_platform_is_found(src, line):
    assert_lines(src, "PREC001", line)


def test_precision_findings_say_what_was_asked_for():
    [f] = found(J + "jax.config.update('jax_default_matmul_precision', 'bfloat16')\n", "PREC001")
    assert "'bfloat16'" in f.message and f.severity == "info"
    [f] = found(J + "jax.default_matmul_precision('float32')\n", "PREC001")
    assert "context manager" in f.message
    [f] = found(J + "y = jnp.dot(x, w, precision='default')\n", "PREC001")
    assert "platform-default" in f.message
    assert f.col == len("y = jnp.dot(x, w, precision=") + 1


# FP16001 -------------------------------------------------------------------------------------

FP16_CASES = [
    # float16 named as a dtype in JAX code, on the line it is named
    (J + "x = jnp.zeros(3)\ny = x.astype(jnp.float16)\n", 4),
    (J + "y = x.astype(jnp.half)\n", 3),
    ("import jax\nimport numpy as np\ny = x.astype(np.float16)\n", 3),
    (J + "y = x.astype('float16')\n", 3),
    (J + "y = jnp.zeros(3, dtype='float16')\n", 3),
    (J + "layer = Dense(4, param_dtype='float16')\n", 3),
    (J + "dt = jnp.dtype('float16')\n", 3),
    (J + "compute_dtype = 'float16'\n", 3),
    (J + "self.compute_dtype: str = 'float16'\n", 3),
    (J + "policy = {'dtype': jnp.float16, 'lr': 0.1}\n", 3),
    (J + "pair = (jnp.float16, 3)\n", 3),
    (J + "y = jnp.zeros(\n    3,\n    dtype=jnp.float16,\n)\n", 5),
    # strings that are not dtypes, and float16 only compared, tested or tabulated
    (J + "print('float16')\n", None),
    (J + "mode = 'float16'\n", None),
    (J + "log(name='float16')\n", None),
    (J + "y = jnp.array(x, 'float16')\n", None),
    (J + "y = x.astype('bfloat16')\n", None),
    (J + "if x.dtype == jnp.float16:\n    pass\n", None),
    (J + "ok = x.dtype in (jnp.float16,)\n", None),
    (J + "ok = isinstance(x, jnp.float16)\n", None),
    (J + "ok = jnp.issubdtype(x.dtype, jnp.float16)\n", None),
    (J + "ok = issubclass(t, jnp.float16)\n", None),
    (J + "HALF = (jnp.float16, jnp.bfloat16)\n", None),
    (J + "HALF = [jnp.float16, 'bfloat16']\n", None),
    (J + "HALF = {jnp.float16, jnp.float32}\n", None),
    (J + "DTYPES = {'fp16': jnp.float16, 'bf16': jnp.bfloat16}\n", None),
    (J + "ok = check(jnp.float16)\n", 3),
    # numpy-only code: float16 on the host is storage, unless it is chosen as a dtype
    ("import numpy as np\ny = arr.astype(np.float16)\n", None),
    ("import numpy as np\nhalf = np.float16(3)\n", None),
    ("import numpy as np\ndtype = np.float16\n", 2),
    ("import numpy as np\nself.compute_dtype = np.float16\n", 2),
    ("import numpy as np\nx = model_dtype = np.float16\n", 2),
    ("import numpy as np\ncompute_dtype: type = np.float16\n", 2),
    ("import numpy as np\ny = np.zeros(3, dtype=np.float16)\n", 2),
    ("import numpy as np\ny = np.zeros(3, kind=np.float16)\n", None),
]


@pytest.mark.parametrize("src,line", FP16_CASES)
def test_float16_as_a_dtype_is_found(src, line):
    assert_lines(src, "FP16001", line)


@pytest.mark.parametrize("scaling", [
    "from flax.training.dynamic_scale import DynamicScale\n",
    "loss_scale = 2.0 ** 15\n",
    "import jmp\npolicy = jmp.DynamicLossScale(2.0 ** 15)\n",
])
def test_float16_with_loss_scaling_in_the_file_is_not_found(scaling):
    src = J + scaling + "y = x.astype(jnp.float16)\nz = x.astype('float16')\n"
    assert found(src, "FP16001") == []


def test_the_float16_finding_is_a_warning_about_loss_scaling():
    [f] = found(J + "y = x.astype(jnp.float16)\n", "FP16001")
    assert "no loss scaling" in f.message and f.severity == "warning"
    assert f.col == len("y = x.astype(") + 1


# GCS001 --------------------------------------------------------------------------------------

GCS_CASES = [
    # Cloud Storage paths, plain or formatted
    ("CKPT = 'gs://my-bucket/run1/ckpt'\n", 1),
    ("x = 1\nsave(state, f'gs://{bucket}/ckpt/{step}')\n", 2),
    ("cmd = 'gsutil cp gs://bucket/data.tfrecord /tmp'\n", 1),
    ("doc = '''\nread from\ngs://bucket/x\n'''\n", 1),
    ("p = 'gs://'\n", None),
    ("p = 'gs://Bucket/x'\n", None),
    ("p = 's3://bucket/x'\n", None),
    ("p = f'/data/{name}/ckpt'\n", None),
    ("p = b'gs://bucket/x'\n", None),
    # the storage client library and its objects
    ("from google.cloud import storage\n", 1),
    ("import google.cloud.storage\n", 1),
    ("import os\nfrom google.cloud.storage import Client\n", 2),
    ("from google.cloud import bigquery\n", None),
    ("import google.cloud\n", None),
    ("from .google.cloud import storage\n", None),
    # TensorFlow's gfile under its different paths
    ("import tensorflow as tf\nwith tf.io.gfile.GFile(path, 'w') as f:\n    pass\n", 2),
    ("import tensorflow as tf\nok = tf.io.gfile.exists(path)\n", 2),
    ("import tensorflow as tf\nf = tf.gfile.Open(path)\n", 2),
    ("with tf.io.gfile.GFile(path) as f:\n    pass\n", 1),
    ("import tensorflow\ntensorflow.compat.v2.io.gfile.makedirs(path)\n", 2),
    ("from tensorflow.io import gfile\nnames = gfile.listdir(path)\n", 2),
    ("import tensorflow as tf\ndata = tf.io.read_file(path)\n", None),
    ("import utils\nok = utils.gfile.exists(path)\n", None),
    ("import tensorflow as tf\nwith open(path) as f:\n    pass\n", None),
]


@pytest.mark.parametrize("src,line", GCS_CASES)
def test_cloud_storage_paths_and_apis_are_found(src, line):
    assert_lines(src, "GCS001", line)


def test_calls_on_a_storage_client_are_found():
    src = ("from google.cloud import storage\n"
           "client = storage.Client()\n"
           "bucket = client.bucket(name)\n"
           "other = Session()\n"
           "other.bucket(name)\n")
    fs = found(src, "GCS001")
    assert [f.line for f in fs] == [1, 2, 3]
    assert "`google.cloud.storage` is imported" in fs[0].message
    assert "`Client` of `google.cloud.storage`" in fs[1].message
    assert "`client.bucket(...)` calls a Cloud Storage client" in fs[2].message


def test_a_name_not_bound_to_a_storage_client_is_not_one():
    src = ("from google.cloud import storage\n"
           "client = make_client()\n"
           "client.bucket(name)\n"
           "self.c = storage.Client()\n")
    assert [f.line for f in found(src, "GCS001")] == [1, 4]


def test_the_import_finding_names_the_storage_module_among_others():
    [f] = found("from google.cloud import bigquery, storage\n", "GCS001")
    assert "`google.cloud.storage` is imported" in f.message


def test_gfile_findings_name_the_call_and_its_module():
    [f] = found("import tensorflow as tf\nok = tf.io.gfile.exists(path)\n", "GCS001")
    assert "`exists` of `tensorflow.io.gfile`" in f.message


def test_a_formatted_path_is_shown_with_its_placeholders_and_found_once():
    [f] = found("p = f'gs://{bucket}/ckpt/{step:06d}'\n", "GCS001")
    assert "`gs://{}/ckpt/{}`" in f.message
    assert f.severity == "warning"


def test_a_path_in_a_longer_string_is_shown_alone():
    [f] = found("cmd = 'gsutil cp gs://bucket/data.tfrecord /tmp'\n", "GCS001")
    assert "`gs://bucket/data.tfrecord` is a Cloud Storage path" in f.message


def test_a_long_path_is_shortened_in_the_message():
    path = "gs://bucket/" + "a" * 100
    [f] = found(f"p = '{path}'\n", "GCS001")
    assert f"`{path[:57]}...`" in f.message
    exact = "gs://bucket/" + "b" * 48  # 60 characters: shown whole
    [f] = found(f"p = '{exact}'\n", "GCS001")
    assert f"`{exact}`" in f.message
    longer = exact + "c"  # 61 characters: shortened
    [f] = found(f"p = '{longer}'\n", "GCS001")
    assert f"`{longer[:57]}...`" in f.message


# TPUENV001 -----------------------------------------------------------------------------------

TPUENV_CASES = [
    # read
    ("import os\nargs = os.environ.get('LIBTPU_INIT_ARGS', '')\n", 2),
    ("import os\nname = os.getenv('TPU_NAME')\n", 2),
    ("import os\nos.environ.pop('TPU_ZONE', None)\n", 2),
    ("import os\naddr = os.environ['COLAB_TPU_ADDR']\n", 2),
    ("from os import environ\nc = environ['XRT_TPU_CONFIG']\n", 2),
    ("import os\nt = os.environ.get('CLOUD_TPU_TASK_ID')\n", 2),
    ("import os\nv = os.environ.get('JAX_USE_PJRT_C_API_ON_TPU')\n", 2),
    # set
    ("import os\nos.environ['LIBTPU_INIT_ARGS'] = '--xla_tpu_enable_latency_hiding_scheduler=true'\n", 2),
    ("import os\nos.environ.setdefault('TPU_NAME', 'local')\n", 2),
    ("import os\nos.environ.update({'TPU_ZONE': 'us-central2-b'})\n", 2),
    ("import os\nos.environ.update(COLAB_TPU_ADDR='10.0.0.2')\n", 2),
    ("import os\nos.putenv('JAX_USE_PJRT_C_API_ON_TPU', '1')\n", 2),
    ("import os\nos.environ['XRT_TPU_CONFIG'] += ';x'\n", 2),
    # not TPU variables, not the environment, or not a named variable
    ("import os\nv = os.environ.get('XLA_FLAGS')\n", None),
    ("import os\nv = os.environ.get('MY_TPU_NAME')\n", None),
    ("import os\nv = os.environ.get('TPUS')\n", None),
    ("import os\nv = os.environ.get(name)\n", None),
    ("import os\nv = os.getenv()\n", None),
    ("import os\nv = os.environ[name]\n", None),
    ("import os\ndel os.environ['TPU_NAME']\n", None),
    ("v = config.get('TPU_NAME')\n", None),
    ("v = settings['TPU_NAME']\n", None),
    ("settings['TPU_NAME'] = 'x'\n", None),
]


@pytest.mark.parametrize("src,line", TPUENV_CASES)
def test_tpu_only_environment_variables_are_found(src, line):
    assert_lines(src, "TPUENV001", line)


def test_tpu_variable_findings_say_whether_it_is_read_or_set():
    [read] = found("import os\nv = os.environ.get('LIBTPU_INIT_ARGS')\n", "TPUENV001")
    assert "`LIBTPU_INIT_ARGS` is read" in read.message
    [read] = found("import os\nv = os.environ['TPU_NAME']\n", "TPUENV001")
    assert "`TPU_NAME` is read" in read.message
    [written] = found("import os\nos.environ['LIBTPU_INIT_ARGS'] = ''\n", "TPUENV001")
    assert "`LIBTPU_INIT_ARGS` is set" in written.message
    assert written.severity == "warning"


# ENV001, TPU001 and PREC001 from environment variables ----------------------------------------

ENV_CASES = [
    # ENV001: JAX/XLA variables set after the first JAX import, by any kind of write
    ("import jax\nimport os\nos.environ['XLA_FLAGS'] = '--xla_gpu_autotune_level=2'\n", "ENV001", 3),
    ("import os\nos.environ['XLA_FLAGS'] = '--x'\nimport jax\n", "ENV001", None),
    ("import os\nimport flax\nos.environ['NCCL_DEBUG'] = 'INFO'\n", "ENV001", 3),
    ("import jax\nimport os\nos.environ['XLA_FLAGS'] += ' --x'\n", "ENV001", 3),
    ("import jax\nimport os\nos.environ['XLA_FLAGS']: str = '--x'\n", "ENV001", 3),
    ("import jax\nimport os\nos.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')\n", "ENV001", 3),
    ("import jax\nimport os\nos.putenv('CUDA_VISIBLE_DEVICES', '0')\n", "ENV001", 3),
    ("import jax\nimport os\nos.environ.update({'TF_CPP_MIN_LOG_LEVEL': '2'})\n", "ENV001", 3),
    ("import jax\nimport os\nos.environ.update(JAX_TRACEBACK_FILTERING='off')\n", "ENV001", 3),
    ("import jax\nimport os\nos.environ['MY_SETTING'] = '1'\n", "ENV001", None),
    ("import jax\nimport os\nos.environ[key] = '1'\n", "ENV001", None),
    ("import jax\nimport os\nenv = {}\nenv['XLA_FLAGS'] = '--x'\n", "ENV001", None),
    ("import jax\nimport os\nos.environ.setdefault(key, '1')\n", "ENV001", None),
    ("import jax\nimport os\nos.environ.update(**extra)\n", "ENV001", None),
    ("import jax\nimport os\nos.environ.update({**extra})\n", "ENV001", None),
    ("import jax\nimport os\nos.environ.get('XLA_FLAGS')\n", "ENV001", None),
    ("import jax\nimport os\nos.environ.copy({'XLA_FLAGS': 'x'})\n", "ENV001", None),
    # TPU001: the platform set to the TPU
    ("import os\nos.environ['JAX_PLATFORMS'] = 'tpu'\n", "TPU001", 2),
    ("import os\nos.environ['JAX_PLATFORMS'] = 'TPU'\n", "TPU001", 2),
    ("import os\nos.environ['JAX_PLATFORMS'] = 'cuda,tpu'\n", "TPU001", 2),
    ("import os\nos.environ['JAX_PLATFORM_NAME'] = 'tpu'\n", "TPU001", 2),
    ("import os\nos.environ.update(JAX_PLATFORMS='tpu,cpu')\n", "TPU001", 2),
    ("import os\nos.environ.setdefault('JAX_PLATFORMS', 'tpu')\n", "TPU001", 2),
    ("import os\nos.environ['JAX_PLATFORMS'] = 'cuda'\n", "TPU001", None),
    ("import os\nos.environ['JAX_PLATFORMS'] = 'tpux'\n", "TPU001", None),
    ("import os\nos.environ['JAX_PLATFORMS'] = platform\n", "TPU001", None),
    ("import os\nos.environ.setdefault('JAX_PLATFORMS')\n", "TPU001", None),
    ("import os\nos.environ['XLA_PLATFORMS'] = 'tpu'\n", "TPU001", None),
    # PREC001: the default matmul precision set through the environment
    ("import os\nos.environ['JAX_DEFAULT_MATMUL_PRECISION'] = 'bfloat16'\n", "PREC001", 2),
    ("import os\nos.environ['JAX_DEFAULT_MATMUL_PRECISION'] = 'Fastest'\n", "PREC001", 2),
    ("import os\nos.putenv('JAX_DEFAULT_MATMUL_PRECISION', 'default')\n", "PREC001", 2),
    ("import os\nos.environ['JAX_DEFAULT_MATMUL_PRECISION'] = 'float32'\n", "PREC001", None),
    ("import os\nos.environ['JAX_DEFAULT_MATMUL_PRECISION'] = precision\n", "PREC001", None),
    ("import os\nos.environ['XLA_DEFAULT_MATMUL_PRECISION'] = 'bfloat16'\n", "PREC001", None),
]


@pytest.mark.parametrize("src,rule,line", ENV_CASES)
def test_environment_settings_are_checked(src, rule, line):
    assert_lines(src, rule, line)


def test_a_late_setting_names_the_import_it_comes_after():
    [f] = found("import jax\nimport os\nos.environ['XLA_FLAGS'] = '--x'\n", "ENV001")
    assert f.message.endswith("`XLA_FLAGS` is set after `import jax` (line 1)")
    assert f.severity == "error"
    [f] = found("import os\n\nimport optax\nos.environ['XLA_FLAGS'] = '--x'\n", "ENV001")
    assert "after `import optax` (line 3), which imports JAX" in f.message


def test_environment_findings_name_the_variable_and_its_value():
    [f] = found("import os\nos.environ['JAX_PLATFORMS'] = 'tpu,cpu'\n", "TPU001")
    assert "`JAX_PLATFORMS=tpu,cpu`" in f.message and f.severity == "error"
    [f] = found("import os\nos.environ['JAX_DEFAULT_MATMUL_PRECISION'] = 'bfloat16'\n", "PREC001")
    assert "`JAX_DEFAULT_MATMUL_PRECISION=bfloat16`" in f.message


def test_one_write_can_break_several_rules():
    src = "import jax\nimport os\nos.environ.update({'JAX_PLATFORMS': 'tpu', 'LIBTPU_INIT_ARGS': '--x'})\n"
    assert sorted(f.rule for f in check_source(src)) == ["ENV001", "TPU001", "TPUENV001"]


def settings(src: str) -> list[tuple]:
    check = check_sources([("train.py", src)])
    return [(e.line, e.name, e.value, e.before_import) for e in check.env_settings]


def test_environment_settings_record_name_value_and_whether_before_the_jax_import():
    src = ("import os\n"
           "os.environ['XLA_FLAGS'] = '--xla_gpu_autotune_level=2'\n"
           "os.environ.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '.9')\n"
           "import jax\n"
           "os.environ['XLA_FLAGS'] += ' --x'\n"
           "os.putenv('NCCL_DEBUG', level)\n"
           "os.environ.update({'TF_CPP_MIN_LOG_LEVEL': '2'}, CUDA_VISIBLE_DEVICES='0')\n"
           "os.environ['HOME'] = '/root'\n"
           "os.environ.setdefault('JAX_ENABLE_X64')\n")
    assert settings(src) == [
        (2, "XLA_FLAGS", "--xla_gpu_autotune_level=2", True),
        (3, "XLA_PYTHON_CLIENT_MEM_FRACTION", ".9", True),
        (5, "XLA_FLAGS", None, False),
        (6, "NCCL_DEBUG", None, False),
        (7, "TF_CPP_MIN_LOG_LEVEL", "2", False),
        (7, "CUDA_VISIBLE_DEVICES", "0", False),
        (9, "JAX_ENABLE_X64", None, False),
    ]


def test_environment_settings_are_listed_in_source_order_wherever_they_are():
    src = ("import os\n"
           "def setup():\n"
           "    os.environ['XLA_FLAGS'] = '--x'\n"
           "os.environ['JAX_PLATFORMS'] = 'cuda'\n"
           "flags = [os.environ.setdefault('NCCL_DEBUG', 'WARN')]; os.environ['JAX_ENABLE_X64'] = '1'\n")
    assert [(line, name) for line, name, _, _ in settings(src)] == [
        (3, "XLA_FLAGS"), (4, "JAX_PLATFORMS"), (5, "NCCL_DEBUG"), (5, "JAX_ENABLE_X64")]
