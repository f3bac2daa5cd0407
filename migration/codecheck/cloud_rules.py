"""Rules for what a TPU job leans on from Google Cloud: GCS001 (Cloud Storage paths and clients) and
TPUENV001 (TPU-only environment variables, read or set)."""

from __future__ import annotations

import ast
import re

from migration.codecheck.ast_helpers import const_str
from migration.codecheck.family import RuleFamily

GCS_PATH = re.compile(r"gs://[a-z0-9{][^\s'\"`]*")  # a bucket name (or a formatted one) after the scheme
GCS_CLIENT = "google.cloud.storage"
# variables only libtpu, the TPU runtime or TPU VMs read: on a GPU machine they do nothing
TPU_ENV_PREFIXES = ("LIBTPU_", "TPU_", "XRT_TPU_", "CLOUD_TPU_")
TPU_ENV_NAMES = {"JAX_USE_PJRT_C_API_ON_TPU", "TPU_NAME", "TPU_ZONE", "COLAB_TPU_ADDR"}
ENV_READS = {"os.environ.get", "os.getenv", "os.environ.pop", "os.environ.setdefault"}


def is_tpu_env(name: str) -> bool:
    return name.startswith(TPU_ENV_PREFIXES) or name in TPU_ENV_NAMES


def is_storage_api(name: str) -> bool:
    """`google.cloud.storage.*`, and TensorFlow's gfile under any of its paths (`tf.io.gfile.GFile`,
    `tensorflow.compat.v2.io.gfile.makedirs`, `tf.gfile.Open`)."""
    parts = name.split(".")
    return name.startswith(GCS_CLIENT) or parts[0] in ("tensorflow", "tf") and "gfile" in parts[1:-1]


class CloudRules(RuleFamily):
    """GCS001 and TPUENV001, node by node (writes of TPU variables are env_rules' EnvWrite facts)."""

    def __init__(self, ctx, found):
        super().__init__(ctx, found)
        # names bound to a Cloud Storage client or bucket: `client = storage.Client()`
        self.clients = {t.id for n in ctx.of(ast.Assign) if isinstance(n.value, ast.Call)
                        and ctx.resolve(n.value.func).startswith(GCS_CLIENT) for t in n.targets
                        if isinstance(t, ast.Name)}

    def imports(self, node: ast.AST, names: list[str]) -> None:
        hit = next((n for n in names if n.startswith(GCS_CLIENT)), None)
        if hit:
            self.add(node, "GCS001", f"`{hit}` is imported: the job reads or writes Google Cloud Storage")

    def call(self, node: ast.Call, name: str) -> None:
        func = node.func
        if is_storage_api(name):
            self.add(node, "GCS001", f"`{name.rsplit('.', 1)[-1]}` of `{name.rsplit('.', 1)[0]}` works on Cloud "
                                     "Storage buckets (or local files through TensorFlow)")
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in self.clients:
            self.add(node, "GCS001", f"`{func.value.id}.{func.attr}(...)` calls a Cloud Storage client")
        if name in ENV_READS and node.args and is_tpu_env(const_str(node.args[0]) or ""):
            self.add(node, "TPUENV001", f"`{const_str(node.args[0])}` is read: only the TPU runtime sets or uses it")

    def subscript(self, node: ast.Subscript) -> None:
        key = const_str(node.slice)
        if isinstance(node.ctx, ast.Load) and key and is_tpu_env(key) and self.ctx.resolve(node.value) == "os.environ":
            self.add(node, "TPUENV001", f"`{key}` is read: only the TPU runtime sets or uses it")

    def string(self, node: ast.Constant | ast.JoinedStr) -> None:
        # an f-string reads with `{}` for each formatted value: f"gs://{bucket}/ckpt" is "gs://{}/ckpt"
        text = "".join(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "{}"
                       for v in getattr(node, "values", [node]))
        path = m.group(0) if (m := GCS_PATH.search(text)) else ""
        if path:
            shown = path if len(path) <= 60 else path[:57] + "..."
            self.add(node, "GCS001", f"`{shown}` is a Cloud Storage path")
