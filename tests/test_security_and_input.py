"""Security and input handling of the launched app, end to end: real servers on free ports, real HTTP,
real gradio_client calls, real workers (nothing mocked).

A. bad input is refused through the API with a one-line message naming the field and what is allowed;
B. the code check reads source and never runs it, and refuses oversized or non-UTF-8 input;
C. CSV exports cannot carry a spreadsheet formula;
D. the file route serves exports and nothing else;
E. with auth on, nothing is served without a session, and users only stop their own jobs;
F. start-up says which interfaces it serves, and the caches are private;
G. old exports are removed.
"""

from __future__ import annotations

import csv
import json
import math
import os
import stat
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

gradio_client = pytest.importorskip("gradio_client")
httpx = pytest.importorskip("httpx")
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError, AuthenticationError

from migration.codecheck import MAX_SOURCE_BYTES
from tests.server import ROOT, Server, users_file

pytestmark = pytest.mark.slow

MAX_STEPS = 500  # the --max-steps of the main server
FORMULA_LABEL = '=HYPERLINK("http://evil.example","x")'


def call_http(base_url: str, api: str, data: list[Any], cookies: Any = None,
              headers: dict[str, str] | None = None) -> tuple[str, Any]:
    """POST {"data": [...]} to /gradio_api/call/<api>, then read the event stream to its end:
    ("complete", outputs) or ("error", message). The body is encoded by `json.dumps`, which writes
    NaN and Infinity as Python's json module reads them back (gradio_client refuses to send those)."""
    url = f"{base_url}gradio_api/call/{api.strip('/')}"
    r = httpx.post(url, content=json.dumps({"data": data}),
                   headers={"content-type": "application/json", **(headers or {})}, cookies=cookies, timeout=60)
    assert r.status_code == 200, (r.status_code, r.text)
    event_id = r.json()["event_id"]
    event = None
    with httpx.stream("GET", f"{url}/{event_id}", cookies=cookies, headers=headers, timeout=300) as stream:
        for line in stream.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event in ("complete", "error"):
                payload = json.loads(line.split(":", 1)[1])
                if event == "error" and isinstance(payload, dict):
                    payload = payload.get("error")
                return event, payload
    raise AssertionError(f"the event stream of {api} ended without complete or error")


def value_of(output: Any) -> Any:
    """A component's value from an output that may be a gr.update dict."""
    return output["value"] if isinstance(output, dict) and "__type__" in output else output


# -- the servers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The module's two long-lived servers, started together (a start is mostly imports that keep one
    core busy; the CI machine has two): the main one and the one with auth."""
    main = Server(tmp_path_factory.mktemp("main"), "--max-steps", str(MAX_STEPS), pre_create_cache=True, wait=False)
    tmp = tmp_path_factory.mktemp("auth")
    users = users_file(tmp / "users.txt", {"alice": "pw1", "bob": "pw2"})
    auth = Server(tmp, "--auth-file", str(users), "--admins", "alice", wait=False)
    yield main, auth
    main.close()
    auth.close()


@pytest.fixture(scope="module")
def server(launched):
    """No auth, default host, --max-steps 500; cache folders pre-created world-readable."""
    s = launched[0]
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def client(server):
    return server.connect()


@pytest.fixture(scope="module")
def auth_server(launched):
    """--auth-file with the users alice and bob."""
    s = launched[1]
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def formula_run(server, client):
    """A short run on this machine labelled with a spreadsheet formula; its outputs (the MLP: the
    quickest model to plan and compile)."""
    form = [*(FORM | {"workload": "mlp"}).values()]
    outputs = client.predict(None, 3, 0.003, False, False, False, False, False, *form, FORMULA_LABEL, api_name="/run")
    assert "Run finished" in outputs[0], outputs[0]
    return outputs


# -- A. bad input --------------------------------------------------------------------------------

# The Migrate form's inputs in the app's order, with values that are valid together (this machine as
# the target: fastest on a CPU host).
FORM = {"workload": "transformer", "preset": "tiny", "source": "tpu-v5e-8", "global_batch": 32, "per_core_batch": 0,
        "source_precision": "bf16", "target": "local", "gpus": 1, "memory_fraction": 0.8,
        "granularity": "multiple8", "remat": "auto", "precision": "auto", "accumulation": 0, "n_layers": 0,
        "d_model": 0, "n_heads": 0, "n_kv_heads": 0, "d_ff": 0, "vocab_size": 0, "seq_len": 0, "embeddings": "preset",
        "sharding": "auto", "gpus_per_node": 8}
RUN_OPTIONS = {"plan_file": None, "steps": 3, "learning_rate": 0.003, "compare_tpu": False, "profile": False,
               "fp32_reference": False, "pmap_before": False, "scaling": False}
INPUTS = {
    "/plan": [*FORM, "label", "network_gbps", "attention", "layer_loop", "train_tokens", "prices", "source_slices",
              "tpu_step_ms", "allow_fp8", "mu_dtype", "config_file"],
    "/run": [*RUN_OPTIONS, *FORM, "label", "save_checkpoint", "restore_checkpoint", "seed", "network_gbps",
             "attention", "layer_loop", "train_tokens", "prices", "source_slices", "tpu_step_ms", "allow_fp8",
             "mu_dtype", "config_file"],
    "/history": ["scope", "kind", "workload", "status"],  # workload: "transformer" is a valid filter too
    "/compare": ["ids", "scope"],
    "/export_csv": ["ids", "scope"],
    "/export_history_csv": ["scope"],
    "/cancel_job": ["job_id"],
}
DEFAULTS = {**FORM, **RUN_OPTIONS, "label": "", "save_checkpoint": "", "restore_checkpoint": "", "scope": "mine", "kind": "all", "status": "all", "ids": "1,2",
            "job_id": "1", "seed": 0, "tpu_step_ms": 0.0, "network_gbps": 0.0, "attention": "auto", "layer_loop": "scan",
            "train_tokens": 1e12, "prices": "", "source_slices": 1, "allow_fp8": False, "mu_dtype": "float32",
            "config_file": None}
NOT_A_PLAN = object()  # replaced by an uploaded JSON file that is not a plan
# configs uploaded in place of the form's model: file name -> content (replaced by the uploaded file)
CONFIG_UPLOADS = {
    "moe.json": '{"model_type": "dbrx", "d_model": 6144, "ffn_config": {"moe_num_experts": 16}}',
    "bomb.yml": "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b]\n"
                "model_name: llama2-7b\n",
    "tag.yml": "model_name: !!python/object/apply:os.system [touch /tmp/pwned]\n",
    "notes.yml": "hello: world\nsteps: 3\n",
    "wrong-type.yml": "model_name: llama2-7b\nper_device_batch_size: four\n",
    "big.json": "{" + " " * 70_000 + "}",
    "tensor-3.yml": "model_name: llama2-7b\nici_tensor_parallelism: 3\n",
    "expert-3.yml": "model_name: mixtral-8x7b\nsparse_matmul: false\ncapacity_factor: 1.25\nici_expert_parallelism: 3\n",
    "moe-top-k-huge.yml": "decoder_block: mixtral\nnum_experts: 8\nnum_experts_per_tok: 1000000\n",
    "tensor-huge.yml": "model_name: llama2-7b\nici_tensor_parallelism: 99999999\n",
    # every dimension at its bound: 1,024 experts of 262,144 hidden units, top 64, 256 layers of 65,536
    "moe-largest.json": json.dumps({
        "model_type": "mixtral", "hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 256,
        "num_attention_heads": 1024, "num_key_value_heads": 1024, "vocab_size": 1048576,
        "max_position_embeddings": 131072, "num_local_experts": 1024, "num_experts_per_tok": 64,
        "tie_word_embeddings": False, "hidden_act": "silu"}),
}


class Upload(str):
    """A value of the case that is uploaded as a file of this name (CONFIG_UPLOADS)."""
WHOLE = "must be a whole number from 1 to"
SERVER_STEPS = f"from 1 to {MAX_STEPS} (this server's per-user limit)"
IDS = "run ids from the History table separated by commas, like 3,5"
@dataclass(frozen=True)
class Bad:
    id: str
    api: str
    values: dict[str, Any]
    field: str  # the field the message must name
    allowed: str  # a piece of what the message must say is allowed
    http: bool = False  # NaN/inf: sent by plain HTTP (gradio_client does not send them)
    extra: tuple[str, ...] = field(default=())  # further text the message must hold


BAD = [
    # numbers: zero, negative, huge, non-finite, fractions, text, None
    Bad("plan-global-batch-0", "/plan", {"global_batch": 0}, "global_batch", WHOLE),
    Bad("plan-global-batch-negative", "/plan", {"global_batch": -1}, "global_batch", WHOLE),
    Bad("plan-global-batch-huge", "/plan", {"global_batch": 10**12}, "global_batch", WHOLE),
    Bad("plan-global-batch-nan", "/plan", {"global_batch": math.nan}, "global_batch", WHOLE, http=True),
    Bad("plan-global-batch-inf", "/plan", {"global_batch": math.inf}, "global_batch", WHOLE, http=True),
    Bad("plan-global-batch-minus-inf", "/plan", {"global_batch": -math.inf}, "global_batch", WHOLE, http=True),
    Bad("plan-global-batch-fraction", "/plan", {"global_batch": 256.5}, "global_batch", WHOLE),
    Bad("plan-global-batch-text", "/plan", {"global_batch": "abc"}, "global_batch", WHOLE),
    Bad("plan-global-batch-empty", "/plan", {"global_batch": ""}, "global_batch", WHOLE),
    Bad("plan-global-batch-exponent-text", "/plan", {"global_batch": "1e3"}, "global_batch", WHOLE),
    Bad("plan-global-batch-none", "/plan", {"global_batch": None}, "global_batch", WHOLE),
    Bad("plan-gpus-fraction", "/plan", {"gpus": 2.5}, "gpus", "whole number from 1 to 4096"),
    Bad("plan-gpus-0", "/plan", {"gpus": 0}, "gpus", "whole number from 1 to 4096"),
    Bad("plan-gpus-none", "/plan", {"gpus": None}, "gpus", "whole number from 1 to 4096"),
    Bad("plan-per-core-negative", "/plan", {"per_core_batch": -8}, "per_core_batch", "0: global batch / the TPU's cores"),
    Bad("plan-accumulation-fraction", "/plan", {"accumulation": 0.5}, "accumulation_steps", "0: chosen by the planner"),
    Bad("plan-memory-fraction-0", "/plan", {"memory_fraction": 0}, "memory_fraction", "number from 0.05 to 1"),
    Bad("plan-memory-fraction-nan", "/plan", {"memory_fraction": math.nan}, "memory_fraction",
        "number from 0.05 to 1", http=True),
    Bad("plan-memory-fraction-text", "/plan", {"memory_fraction": "abc"}, "memory_fraction", "number from 0.05 to 1"),
    # unknown names
    Bad("plan-unknown-workload", "/plan", {"workload": "resnet"}, "workload", "one of mlp, cnn, transformer"),
    Bad("plan-empty-workload", "/plan", {"workload": ""}, "workload", "one of mlp, cnn, transformer"),
    Bad("plan-unknown-preset", "/plan", {"preset": "huge"}, "preset", "one of tiny"),
    Bad("plan-preset-of-another-workload", "/plan", {"workload": "mlp", "preset": "gpt2-small"}, "preset", "one of tiny"),
    Bad("plan-unknown-source", "/plan", {"source": "tpu-v9-8"}, "source", "a TPU slice as Google Cloud names it"),
    Bad("plan-unknown-slice-size", "/plan", {"source": "v5p-1000"}, "source", "v5p slices are v5p-8, v5p-16"),
    Bad("plan-no-slices", "/plan", {"source": "0xv6e-256"}, "source", "a job of 1 to 64 slices"),
    Bad("plan-unknown-target", "/plan", {"target": "mi300x"}, "target", "h100-sxm"),
    Bad("plan-none-target", "/plan", {"target": None}, "target", "one of local"),
    Bad("plan-unknown-source-precision", "/plan", {"source_precision": "fp8"}, "source_precision", "one of bf16, fp32"),
    Bad("plan-unknown-precision", "/plan", {"precision": "fp64"}, "precision", "one of auto, fp32, bf16, fp16"),
    Bad("plan-unknown-remat", "/plan", {"remat": "everything"}, "remat", "one of auto, none, dots"),
    Bad("plan-unknown-granularity", "/plan", {"granularity": "pow3"}, "granularity", "one of multiple8, pow2"),
    Bad("plan-unknown-sharding", "/plan", {"sharding": "zero3"}, "sharding", "must be replicated, fsdp or hybrid:G"),
    Bad("plan-layout-shell", "/plan", {"sharding": "fsdp; rm -rf /"}, "sharding", "must be replicated, fsdp or hybrid:G"),
    Bad("plan-layout-long", "/plan", {"sharding": "hybrid:" + "9" * 10000}, "sharding", "hybrid:G"),
    Bad("plan-layout-none", "/plan", {"sharding": None}, "sharding", "must be replicated, fsdp or hybrid:G"),
    Bad("plan-layout-group-too-big", "/plan", {"sharding": "hybrid:99999", "gpus": 8, "target": "h100-sxm"}, "sharding",
        "the FSDP group must divide the GPUs"),
    Bad("plan-layout-tp-odd", "/plan", {"sharding": "fsdp+tp3", "gpus": 8, "target": "h100-sxm"}, "sharding",
        "a power of two"),
    Bad("plan-network-negative", "/plan", {"network_gbps": -400}, "network_gbps", "number from 0 to 12800"),
    Bad("plan-network-nan", "/plan", {"network_gbps": math.nan}, "network_gbps", "number from 0 to 12800", http=True),
    Bad("plan-network-text", "/plan", {"network_gbps": "fast"}, "network_gbps", "number from 0 to 12800"),
    Bad("plan-attention-path", "/plan", {"attention": "../../etc/passwd"}, "attention", "one of auto, cudnn, xla"),
    Bad("plan-layer-loop-code", "/plan", {"layer_loop": "__import__('os')"}, "layer_loop", "one of scan, unrolled"),
    Bad("plan-layer-loop-mlp", "/plan", {"workload": "mlp", "layer_loop": "unrolled"}, "layer_loop", "not a dimension"),
    Bad("run-layout-shell", "/run", {"sharding": "$(reboot)"}, "sharding", "must be replicated, fsdp or hybrid:G"),
    # the comparison's tokens, prices and measured TPU step
    Bad("plan-train-tokens-small", "/plan", {"train_tokens": 5}, "train_tokens", "number from 1e+06 to 1e+16"),
    Bad("plan-train-tokens-huge", "/plan", {"train_tokens": 1e30}, "train_tokens", "number from 1e+06 to 1e+16"),
    Bad("plan-train-tokens-nan", "/plan", {"train_tokens": math.nan}, "train_tokens", "number from 1e+06", http=True),
    Bad("plan-price-negative", "/plan", {"prices": "tpu-v5e=-1"}, "prices", "a positive number of dollars per chip-hour"),
    Bad("plan-price-zero", "/plan", {"prices": "h100-sxm=0"}, "prices", "a positive number of dollars per GPU-hour"),
    Bad("plan-price-text", "/plan", {"prices": "h100-sxm=cheap"}, "prices", "a positive number"),
    Bad("plan-price-nan-text", "/plan", {"prices": "h100-sxm=nan"}, "prices", "a positive number"),
    Bad("plan-price-unknown-key", "/plan", {"prices": "tpu-v9=3"}, "prices", "tpu-{v3,v4,v5e,v5p,v6e}"),
    Bad("plan-price-no-equals", "/plan", {"prices": "h100-sxm 3"}, "prices", "key=dollars"),
    Bad("plan-price-shell", "/plan", {"prices": "h100-sxm=$(reboot)"}, "prices", "a positive number"),
    Bad("plan-price-long", "/plan", {"prices": "h100-sxm=1," * 200}, "prices", "at most 600 characters"),
    Bad("plan-price-none", "/plan", {"prices": None}, "prices", "key=dollars pairs"),
    Bad("plan-slices-0", "/plan", {"source_slices": 0}, "source_slices", "whole number from 1 to 64"),
    Bad("plan-slices-huge", "/plan", {"source_slices": 10**6}, "source_slices", "whole number from 1 to 64"),
    Bad("plan-slices-contradict-per-core", "/plan", {"source_slices": 2, "global_batch": 256, "per_core_batch": 32},
        "per_core_batch", "use per_core_batch 16", extra=("16 cores",)),
    Bad("plan-tpu-step-negative", "/plan", {"tpu_step_ms": -5}, "tpu_step_ms", "number from 0 to"),
    Bad("plan-allow-fp8-text", "/plan", {"allow_fp8": "yes"}, "allow_fp8", "must be true or false"),
    Bad("plan-mu-dtype-fp16", "/plan", {"mu_dtype": "float16"}, "mu_dtype", "float32, bfloat16"),
    Bad("plan-mu-dtype-code", "/plan", {"mu_dtype": "__import__('os').system('id')"}, "mu_dtype", "float32, bfloat16"),
    Bad("run-mu-dtype-path", "/run", {"mu_dtype": "../../../etc/passwd"}, "mu_dtype", "float32, bfloat16"),
    Bad("plan-fp8-without-fp8-units", "/plan", {"precision": "fp8", "target": "a100-80gb"}, "precision",
        "A100 SXM4 80GB has compute capability 8.0"),
    Bad("plan-mxfp8-on-hopper", "/plan", {"precision": "mxfp8", "target": "h100-sxm"}, "precision",
        "mxfp8 needs Blackwell"),
    Bad("run-price-negative", "/run", {"prices": "tpu-v5e=-1"}, "prices", "a positive number"),
    Bad("plan-unknown-embeddings", "/plan", {"embeddings": "shared"}, "embeddings", "one of preset, tied, untied"),
    Bad("plan-workload-reference", "/plan", {"workload": "os:system"}, "workload", "one of mlp, cnn, transformer"),
    # model dimensions: ranges, consistency, and dimensions the workload does not have
    Bad("plan-layers-negative", "/plan", {"n_layers": -1}, "n_layers", "0: the preset's"),
    Bad("plan-layers-fraction", "/plan", {"n_layers": 2.5}, "n_layers", "0: the preset's"),
    Bad("plan-kv-heads-not-dividing", "/plan", {"n_kv_heads": 3}, "n_kv_heads", "must divide n_heads (4)"),
    Bad("plan-heads-not-dividing-d-model", "/plan", {"n_heads": 5}, "n_heads", "must divide d_model (64)"),
    Bad("plan-dimension-of-another-workload", "/plan", {"workload": "mlp", "n_layers": 4}, "n_layers",
        "not a dimension of mlp"),
    Bad("plan-gpus-not-whole-nodes", "/plan", {"gpus": 12, "target": "h100-sxm"}, "gpus", "a multiple of 8"),
    Bad("plan-gpus-per-node-0", "/plan", {"gpus_per_node": 0}, "gpus_per_node", "whole number from 1 to 16"),
    # settings that contradict each other
    Bad("plan-per-core-contradicts-global", "/plan", {"global_batch": 256, "per_core_batch": 16}, "per_core_batch",
        "use per_core_batch 32", extra=("8 cores", "global_batch is 256")),
    Bad("plan-accumulation-exceeds-global", "/plan", {"global_batch": 32, "accumulation": 64}, "accumulation_steps",
        "at most 32"),
    # labels
    Bad("plan-label-newline", "/plan", {"label": "first\nsecond"}, "label", "one line of text"),
    Bad("plan-label-200-chars", "/plan", {"label": "x" * 200}, "label", "at most 80 characters"),
    Bad("plan-label-none", "/plan", {"label": None}, "label", "text of at most 80 characters"),
    # /run: its own settings, and the form checked there too
    Bad("run-steps-absurd", "/run", {"steps": 10**9}, "steps", SERVER_STEPS),
    Bad("run-steps-above-server-limit", "/run", {"steps": MAX_STEPS + 1}, "steps", SERVER_STEPS),
    Bad("run-steps-0", "/run", {"steps": 0}, "steps", SERVER_STEPS),
    Bad("run-steps-fraction", "/run", {"steps": 2.5}, "steps", SERVER_STEPS),
    Bad("run-steps-text", "/run", {"steps": "abc"}, "steps", SERVER_STEPS),
    Bad("run-steps-none", "/run", {"steps": None}, "steps", SERVER_STEPS),
    Bad("run-steps-nan", "/run", {"steps": math.nan}, "steps", SERVER_STEPS, http=True),
    Bad("run-learning-rate-0", "/run", {"learning_rate": 0}, "learning_rate", "number from 1e-08 to 1"),
    Bad("run-learning-rate-inf", "/run", {"learning_rate": math.inf}, "learning_rate", "number from 1e-08 to 1",
        http=True),
    Bad("run-learning-rate-text", "/run", {"learning_rate": "abc"}, "learning_rate", "number from 1e-08 to 1"),
    Bad("run-global-batch-0", "/run", {"global_batch": 0}, "global_batch", WHOLE),
    Bad("run-tpu-as-target", "/run", {"target": "tpu-v5e-8"}, "target", "one of local"),
    Bad("run-per-core-contradicts-global", "/run", {"global_batch": 256, "per_core_batch": 16}, "per_core_batch",
        "use per_core_batch 32"),
    Bad("run-label-newline", "/run", {"label": "a\r\nb"}, "label", "one line of text"),
    Bad("run-label-200-chars", "/run", {"label": "y" * 200}, "label", "at most 80 characters"),
    Bad("run-plan-file-not-a-plan", "/run", {"plan_file": NOT_A_PLAN}, "plan_file",
        "python -m migration plan --json"),
    Bad("plan-config-moe", "/plan", {"config_file": Upload("moe.json")}, "config_file", "model_type=dbrx"),
    Bad("plan-config-yaml-alias-bomb", "/plan", {"config_file": Upload("bomb.yml")}, "config_file", "alias"),
    Bad("plan-config-python-tag", "/plan", {"config_file": Upload("tag.yml")}, "config_file", "neither JSON nor YAML"),
    Bad("plan-config-neither-format", "/plan", {"config_file": Upload("notes.yml")}, "config_file",
        "neither a Hugging Face config.json"),
    Bad("plan-config-wrong-type", "/plan", {"config_file": Upload("wrong-type.yml")}, "config_file",
        "per_device_batch_size: expected a number"),
    Bad("plan-config-too-big", "/plan", {"config_file": Upload("big.json")}, "config_file", "over 64 KiB"),
    Bad("plan-config-tensor-not-dividing", "/plan", {"config_file": Upload("tensor-3.yml")}, "source_tensor",
        "a power of two that divides the slice's"),
    Bad("plan-config-expert-not-dividing", "/plan", {"config_file": Upload("expert-3.yml")}, "source_expert",
        "must divide the slice's"),
    Bad("plan-config-moe-top-k-huge", "/plan", {"config_file": Upload("moe-top-k-huge.yml")}, "config_file",
        "num_experts_per_tok: expected an integer from 1 to 64"),
    Bad("plan-config-tensor-huge", "/plan", {"config_file": Upload("tensor-huge.yml")}, "config_file",
        "ici_tensor_parallelism: expected an integer from 1 to 4096"),
    Bad("run-config-moe", "/run", {"config_file": Upload("moe.json")}, "config_file", "mixture-of-experts"),
    Bad("run-save-checkpoint-absolute", "/run", {"save_checkpoint": "/etc/cron.d"}, "save_checkpoint",
        "absolute paths are not allowed"),
    Bad("run-restore-checkpoint-dotdot", "/run", {"restore_checkpoint": "../../home"}, "restore_checkpoint",
        "'..' is not allowed"),
    # history filters, selections, job ids
    Bad("history-unknown-kind", "/history", {"kind": "runs"}, "kind", "one of all, run, plan"),
    Bad("history-none-kind", "/history", {"kind": None}, "kind", "one of all, run, plan"),
    Bad("history-unknown-workload", "/history", {"workload": "gpt"}, "workload", "one of all, mlp, cnn, transformer"),
    Bad("history-unknown-status", "/history", {"status": "done"}, "status", "one of all, ok, failed"),
    Bad("history-unknown-scope", "/history", {"scope": "yours"}, "scope", "mine"),
    Bad("compare-sql-ids", "/compare", {"ids": "1;DROP TABLE"}, "ids", IDS),
    Bad("compare-or-ids", "/compare", {"ids": "1 OR 1=1"}, "ids", IDS),
    Bad("export-sql-ids", "/export_csv", {"ids": "1;DROP TABLE"}, "ids", IDS),
    Bad("export-path-ids", "/export_csv", {"ids": "../../etc/passwd"}, "ids", IDS),
    Bad("export-history-unknown-scope", "/export_history_csv", {"scope": "all"}, "scope", "mine"),
    Bad("cancel-text-job-id", "/cancel_job", {"job_id": "abc"}, "job_id", "one job id"),
    Bad("cancel-negative-job-id", "/cancel_job", {"job_id": "-1"}, "job_id", "one job id"),
    Bad("cancel-empty-job-id", "/cancel_job", {"job_id": ""}, "job_id", "one job id"),
    Bad("cancel-two-job-ids", "/cancel_job", {"job_id": "1,2"}, "job_id", "one job id"),
]


def _params():
    for case in BAD:
        yield pytest.param(case, id=case.id)


@pytest.fixture(scope="module")
def entries_before_bad_input(client):
    return len(client.predict("everyone", "all", "all", "all", api_name="/history")["data"])


@pytest.fixture(scope="module")
def not_a_plan(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("upload") / "plan.json"
    path.write_text(json.dumps({"status": "ok", "note": "not a plan"}))
    return str(path)


@pytest.fixture(scope="module")
def uploads(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("configs")
    for name, text in CONFIG_UPLOADS.items():
        (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize("case", _params())
def test_bad_input_is_refused_naming_the_field(case: Bad, server, client, entries_before_bad_input, not_a_plan,
                                               uploads):
    values = {**DEFAULTS, **case.values}
    args = [values[name] for name in INPUTS[case.api]]
    if case.http:
        # gradio_client encodes its payload as strict JSON: NaN and ±inf raise ValueError on this side
        # and nothing is sent. The same values go to the server by plain HTTP, as any other client can.
        try:
            client.predict(*args, api_name=case.api)
        except AppError as exc:  # a gradio_client that sends them: the server's answer must hold too
            _check_refusal(case, str(exc))
        except ValueError as exc:
            assert "JSON" in str(exc), exc
        else:
            pytest.fail(f"{case.api} accepted {case.values}")
        event, message = call_http(server.url, case.api, args, headers=server.headers)
        assert event == "error", (event, message)
        _check_refusal(case, str(message))
        return
    args = [handle_file(not_a_plan) if a is NOT_A_PLAN else handle_file(str(uploads / a)) if isinstance(a, Upload)
            else a for a in args]
    with pytest.raises(AppError) as err:
        client.predict(*args, api_name=case.api)
    _check_refusal(case, str(err.value))


def _check_refusal(case: Bad, message: str) -> None:
    assert "Traceback" not in message and 'File "' not in message, message
    assert "\n" not in message, f"not one line: {message!r}"
    assert case.field in message, f"{case.api} {case.values}: the message does not name {case.field!r}: {message!r}"
    assert case.allowed in message, f"{case.api} {case.values}: the message does not say {case.allowed!r}: {message!r}"
    for text in case.extra:
        assert text in message, message


def test_server_keeps_serving_after_bad_input(server, client, entries_before_bad_input):
    history = client.predict("everyone", "all", "all", "all", api_name="/history")
    assert history["headers"][:4] == ["id", "created", "user", "label"]
    assert len(history["data"]) == entries_before_bad_input, "a refused input left a history entry"
    assert server.proc.poll() is None and server.workers() == []


def test_the_largest_moe_a_config_may_describe_is_answered_without_compiling_it(server, client, uploads):
    """A user's config at every MoE bound (13.5 quadrillion parameters) is a plan like any other: answered as
    not feasible, from the state's arithmetic bound, in seconds (no program of that size is compiled), its
    worker gone, and the server answering the next call."""
    values = {**DEFAULTS, "source": "tpu-v5p-1024", "global_batch": 1024, "target": "h100-sxm", "gpus": 8,
              "config_file": handle_file(str(uploads / "moe-largest.json"))}
    t0 = time.monotonic()
    outputs = client.predict(*[values[name] for name in INPUTS["/plan"]], api_name="/plan")
    took = time.monotonic() - t0
    markdown = str(value_of(outputs[5]))
    assert "13,515,351,581,065,216 parameters" in markdown and "NOT FEASIBLE" in markdown.upper(), markdown[:2000]
    assert "more GPUs" in markdown
    assert took < 120, f"{took:.0f} s"
    assert server.proc.poll() is None and server.workers() == []
    rows = client.predict("mine", "all", "all", "all", api_name="/history")["data"]
    assert any(str(cell).startswith("moe /") for row in rows for cell in row), rows  # recorded; still answering


# -- B. the code check never runs its input ------------------------------------------------------

def _hostile_source(folder: Path) -> tuple[str, list[Path]]:
    targets = [folder / name for name in ("pwned", "pwned2", "pwned3", "pwned4", "pwned5")]
    source = "\n".join([
        f'open("{targets[0]}", "w").write("x")',
        f'__import__("os").system("touch {targets[1]}")',
        f'def f(x=open("{targets[2]}", "w").write("x")):',
        "    pass",
        "class C:",
        f'    open("{targets[3]}", "w").write("x")',
        f'exec("open(\'{targets[4]}\', \'w\').write(\'x\')")',
        "import jax",
        "x = jax.device_put_replicated(1, jax.devices())",
        "",
    ])
    return source, targets


def test_code_check_reads_pasted_and_uploaded_source_without_running_it(client, tmp_path):
    source, targets = _hostile_source(tmp_path)
    summary, table = client.predict(source, None, api_name="/code_check")
    rows = value_of(table)["data"]
    assert "finding(s)" in summary and any(row[3] == "REMOVED001" and row[0] == "<pasted>" for row in rows), rows
    upload = tmp_path / "train_hostile.py"
    upload.write_text(source)
    summary, table = client.predict("", [handle_file(str(upload))], api_name="/code_check")
    assert any(row[0] == "train_hostile.py" and row[3] == "REMOVED001" for row in value_of(table)["data"])
    time.sleep(1)
    assert [p.name for p in targets if p.exists()] == []


@pytest.mark.parametrize("kind", ["train", "../serving", "", 3, ["serving"]])
def test_code_check_refuses_a_kind_it_does_not_know_naming_the_two(client, kind):
    """What the code is decides which checklist grades from it: any other value is refused in one line naming
    the two (by the radio's own check, then the handler's), before a worker reads the code."""
    with pytest.raises(AppError) as err:
        client.predict("import jax\n", None, kind, api_name="/code_check")
    message = str(err.value)
    assert "'training', 'serving'" in message and "Traceback" not in message, message


def test_code_check_refuses_an_oversized_paste_naming_the_limit(client):
    text = "x = 1\n" * 200_000  # 1.2 MB
    with pytest.raises(AppError) as err:
        client.predict(text, None, api_name="/code_check")
    message = str(err.value)
    assert f"{MAX_SOURCE_BYTES:,} bytes" in message and "limit" in message and f"{len(text):,}" in message, message
    assert "Traceback" not in message


def test_code_check_refuses_oversized_and_non_utf8_uploads_naming_the_file(client, tmp_path):
    bad = tmp_path / "latin_script.py"
    bad.write_bytes(b"\xff\xfe x = 1\n")
    with pytest.raises(AppError) as err:
        client.predict("", [handle_file(str(bad))], api_name="/code_check")
    message = str(err.value)
    assert "latin_script.py" in message and "UTF-8" in message and "Traceback" not in message, message
    big = tmp_path / "big_script.py"
    big.write_text("x = 1\n" * 200_000)
    with pytest.raises(AppError) as err:
        client.predict("", [handle_file(str(big))], api_name="/code_check")
    message = str(err.value)
    assert "big_script.py" in message and f"{MAX_SOURCE_BYTES:,} bytes" in message and "limit" in message, message


# -- C. CSV exports carry no formula -------------------------------------------------------------

def test_history_export_neutralises_a_formula_label(client, formula_run):
    path = value_of(client.predict("mine", api_name="/export_history_csv"))
    with open(path, newline="") as f:
        raw = list(csv.DictReader(f))
    ours = [row for row in raw if "HYPERLINK" in (row["label"] or "")]
    assert {row["kind"] for row in ours} >= {"run"}, raw
    run = next(row for row in ours if row["kind"] == "run")
    assert run["label"] == "'" + FORMULA_LABEL
    assert all(row["label"].startswith("'=HYPERLINK(") for row in ours)
    frame = pd.read_csv(path)
    assert frame.loc[frame["kind"] == "run", "label"].iloc[0] == "'" + FORMULA_LABEL
    # No cell of the export starts a formula (a leading - or + only on numbers).
    for row in raw:
        for key, cell in row.items():
            if cell and cell[0] in "=@\t\r":
                pytest.fail(f"cell {key}={cell!r} would be evaluated by a spreadsheet")
            if cell and cell[0] in "+-":
                float(cell)
    # The app's own view of the label is unchanged.
    history = client.predict("mine", "run", "all", "all", api_name="/history")
    labels = [row[history["headers"].index("label")] for row in history["data"]]
    assert FORMULA_LABEL in labels


# -- D. the file route ---------------------------------------------------------------------------

def _file_url(server: Server, path: str | Path) -> str:
    return f"{server.url}gradio_api/file={path}"


def test_file_route_refuses_files_outside_the_exports(server, formula_run):
    export_dir = server.cache / "exports"
    refused = [
        "/etc/passwd",
        str(ROOT / "app.py"),
        str(server.db),
        f"{export_dir}/../../{server.db.name}",
        urllib.parse.quote(f"{export_dir}/../../{server.db.name}", safe=""),
        urllib.parse.quote(f"{server.cache / 'gradio'}/../../../../../../etc/passwd", safe=""),
    ]
    for path in refused:
        r = httpx.get(f"{server.url}gradio_api/file={path}", headers=server.headers, timeout=30)
        assert r.status_code in (403, 404), (path, r.status_code, r.text[:200])
        assert "root:" not in r.text and "SQLite format" not in r.text and "def build_demo" not in r.text, path


def test_export_downloads_and_file_names_hold_no_label_text(server, formula_run):
    event, outputs = call_http(server.url, "/export_history_csv", ["mine"], headers=server.headers)
    assert event == "complete", outputs
    data = value_of(outputs[0])
    r = httpx.get(data["url"], headers=server.headers, timeout=30)
    assert r.status_code == 200 and r.text.startswith("id,kind,"), (r.status_code, r.text[:200])
    assert "'=HYPERLINK(" in r.text
    names = [Path(data["path"]).name, data["orig_name"]]
    for folder in (server.cache / "exports", server.cache / "gradio"):
        names += [p.name for p in folder.rglob("*")]
    files = [value_of(formula_run[i]) for i in (3, 5, 6, 7)]  # report CSV, checklist CSV, deployment, trace
    names += [Path(f).name for f in files if f]
    assert len(names) > 5
    for name in names:
        assert not any(text in name for text in ("HYPERLINK", "evil", "http", '"')), name


# -- E. auth on ----------------------------------------------------------------------------------

def test_auth_refuses_plain_http_without_a_session(auth_server):
    base = auth_server.url.rstrip("/")
    requests = [("GET", "/config", None), ("GET", "/gradio_api/info", None),
                ("POST", "/gradio_api/call/history", {"data": ["everyone", "all", "all", "all"]}),
                ("POST", "/gradio_api/queue/join", {"data": ["everyone", "all", "all", "all"], "fn_index": 0,
                                                    "session_hash": "abc123"}),
                ("POST", "/gradio_api/run/history", {"data": ["everyone", "all", "all", "all"]}),
                ("GET", "/gradio_api/file=/etc/passwd", None),
                ("GET", f"/gradio_api/file={auth_server.cache / 'exports'}", None)]
    for method, path, body in requests:
        r = httpx.request(method, base + path, json=body, follow_redirects=False, timeout=30)
        assert r.status_code in (401, 403), (method, path, r.status_code, r.text[:200])
        assert "named_endpoints" not in r.text and "Global batch" not in r.text and "root:" not in r.text
    # The page itself is the login form: its config has no components and no events.
    r = httpx.get(base + "/", follow_redirects=False, timeout=30)
    assert r.status_code == 200
    config = _page_config(r.text)
    assert config["auth_required"] is True and config["components"] == [] and config["dependencies"] == []


def _page_config(page: str) -> dict[str, Any]:
    start = page.index("window.gradio_config = ") + len("window.gradio_config = ")
    return json.JSONDecoder().raw_decode(page[start:])[0]


def test_login_page_does_not_describe_the_api(auth_server):
    r = httpx.get(auth_server.url, follow_redirects=False, timeout=30)
    assert r.status_code == 200, (r.status_code, r.text[:200])
    assert r.headers["content-type"].startswith("text/html")
    # The page is Gradio's login form (auth required, no components, no events), its API description blanked.
    config = _page_config(r.text)
    assert config["auth_required"] is True and config["components"] == [] and config["dependencies"] == []
    assert "window.gradio_api_info = null;</script>" in r.text
    assert "named_endpoints" not in r.text and "cancel_job" not in r.text and "Global batch" not in r.text


def test_auth_client_needs_right_credentials(auth_server):
    with pytest.raises(AuthenticationError, match="credentials"):
        auth_server.connect()
    for auth in (("alice", "wrong"), ("alice", "pw2"), ("carol", "pw1"), ("alice", "")):
        with pytest.raises(ValueError, match="Could not login"):
            auth_server.connect(auth)
    history = auth_server.connect(("alice", "pw1")).predict("mine", "all", "all", "all", api_name="/history")
    assert history["headers"][:3] == ["id", "created", "user"]


def _entry(client: Client, scope: str, label: str, kind: str = "run") -> list[Any] | None:
    history = client.predict(scope, kind, "all", "all", api_name="/history")
    cols = history["headers"]
    rows = [dict(zip(cols, row)) for row in history["data"]]
    return next((row for row in rows if row["label"] == label), None)


def _wait_for(predicate, timeout_s: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def test_users_stop_only_their_own_jobs_and_see_their_own_history(auth_server):
    alice = auth_server.connect(("alice", "pw1"))
    bob = auth_server.connect(("bob", "pw2"))
    form = [*FORM.values()]
    long_run = alice.submit(None, 400, 0.003, False, False, False, False, False, *form, "alice-long", api_name="/run")
    entry = _wait_for(lambda: _entry(alice, "mine", "alice-long"), 20, "alice's run in her history")
    assert entry["status"] in ("queued", "running") and entry["user"] == "alice", entry
    job_id = str(entry["id"])
    _wait_for(auth_server.workers, 180, "a worker for alice's run")

    # bob cannot stop it
    with pytest.raises(AppError) as err:
        bob.predict(job_id, api_name="/cancel_job")
    assert "belongs to another user" in str(err.value) and "Traceback" not in str(err.value), err.value
    assert _entry(alice, "mine", "alice-long")["status"] in ("queued", "running")
    assert auth_server.workers() and not long_run.done()

    # bob's own job, queued behind alice's, is his to stop
    bob_run = bob.submit(None, 3, 0.003, False, False, False, False, False, *form, "bob-queued", api_name="/run")
    bob_entry = _wait_for(lambda: _entry(bob, "mine", "bob-queued"), 20, "bob's run in his history")
    assert "Stopping job" in bob.predict(str(bob_entry["id"]), api_name="/cancel_job")
    _wait_for(lambda: _entry(bob, "mine", "bob-queued")["status"] == "cancelled", 30, "bob's run cancelled")
    bob_run.result(timeout=60)

    # history: mine is mine; everyone's is for the admins the server names (alice), and shows who ran what
    assert _entry(bob, "mine", "alice-long") is None
    with pytest.raises(AppError, match="open only to the admins"):
        bob.predict("everyone", "run", "all", "all", api_name="/history")
    everyone = alice.predict("everyone", "run", "all", "all", api_name="/history")
    cols = everyone["headers"]
    rows = [dict(zip(cols, row)) for row in everyone["data"]]
    assert {row["label"]: row["user"] for row in rows} == {"alice-long": "alice", "bob-queued": "bob"}
    for client, scope, users in ((alice, "everyone", {"alice", "bob"}), (bob, "mine", {"bob"})):
        history = client.predict(scope, "all", "all", "all", api_name="/history")
        shown = {dict(zip(history["headers"], row))["user"] for row in history["data"]}
        assert shown == users, (scope, history["data"])

    # alice stops it: the worker is gone within seconds and the history says cancelled
    assert f"Stopping job #{job_id}" in alice.predict(job_id, api_name="/cancel_job")
    _wait_for(lambda: auth_server.workers() == [], 10, "alice's worker gone")
    _wait_for(lambda: _entry(alice, "mine", "alice-long")["status"] == "cancelled", 30, "alice's run cancelled")
    assert "stopped" in long_run.result(timeout=60)[0]


# -- F. start-up and private caches --------------------------------------------------------------

def test_startup_says_loopback_only_by_default(server):
    line = server.first_line()
    assert "serving on loopback only" in line and f"http://127.0.0.1:{server.port}/" in line, line
    assert "no auth: single-user mode" in line


@pytest.fixture(scope="module")
def short_lived(tmp_path_factory):
    """The two servers each test below starts, stops and reads alone, started together: one on
    0.0.0.0 without auth, one with an export folder that already holds old exports (an hour old,
    readable by everyone) and a limit of about 1 s."""
    exports = tmp_path_factory.mktemp("old-exports") / "exports"
    (exports / "trace-old").mkdir(parents=True)
    os.chmod(exports, 0o755)
    old = [exports / "history-20200101-000000-1.csv", exports / "trace-old" / "trace.json.gz"]
    hour_ago = time.time() - 3600
    for path in old:
        path.write_text("old")
        os.utime(path, (hour_ago, hour_ago))
    (exports / ".tpu-gpu-migration-exports").write_text("")  # this app's folder: its old files may go
    servers = {"all interfaces": Server(tmp_path_factory.mktemp("all-interfaces"), "--host", "0.0.0.0", wait=False),
               "old exports": Server(exports.parent, "--export-dir", str(exports), "--export-max-age-hours", "0.0003",
                                     wait=False)}
    yield {**servers, "old files": old}
    for s in servers.values():
        s.close()


def test_startup_says_all_interfaces_for_0_0_0_0(short_lived):
    s = short_lived["all interfaces"]
    try:
        line = s.first_line()
        assert "serving on ALL interfaces" in line and "0.0.0.0" in line, line
        _wait_for(lambda: "warning: serving beyond loopback without auth" in s.stderr_path.read_text(), 30,
                  "the no-auth warning on stderr")
    finally:
        s.close()


def test_caches_and_exports_are_private(server, formula_run):
    for folder in (server.cache, server.cache / "gradio", server.cache / "exports"):
        assert folder.is_dir(), folder
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, (folder, oct(folder.stat().st_mode))
    assert any((server.cache / "exports").iterdir()), "the run wrote its exports there"


# -- G. old exports are removed ------------------------------------------------------------------

def test_old_exports_are_removed_at_start_up_and_on_export(short_lived):
    s = short_lived["old exports"]
    exports, old = s.tmp / "exports", short_lived["old files"]
    try:
        s.wait_ready()
        assert [p for p in old if p.exists()] == [], "old exports survived start-up"
        assert stat.S_IMODE(exports.stat().st_mode) == 0o700
        client = s.connect()
        client.predict("mine", api_name="/export_history_csv")
        first = sorted(exports.rglob("history-*.csv"))
        assert len(first) == 1, first
        time.sleep(1.5)  # older than the limit now
        client.predict("mine", api_name="/export_history_csv")
        second = sorted(exports.rglob("history-*.csv"))
        assert not first[0].exists() and len(second) == 1, (first, second)
    finally:
        s.close()


BAD_SETTINGS = [
    (["--max-steps", "0"], {}, "--max-steps"),
    (["--jobs-per-user", "abc"], {}, "--jobs-per-user"),
    (["--silence-seconds", "nan"], {}, "--silence-seconds"),
    ([], {"MIGRATION_QUEUE_SIZE": "-3"}, "--queue-size"),
]


@pytest.fixture(scope="module")
def bad_settings_runs():
    """`python app.py` with each bad setting, all started at once (each imports Gradio and JAX before
    it reads its flags): {flag: process}."""
    procs = {flag: subprocess.Popen([sys.executable, "app.py", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
             for argv, env, flag in BAD_SETTINGS}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize("flag", [flag for _, _, flag in BAD_SETTINGS])
def test_bad_server_settings_are_refused_in_one_line(bad_settings_runs, flag):
    _, stderr = bad_settings_runs[flag].communicate(timeout=120)
    assert bad_settings_runs[flag].returncode == 2 and f"argument {flag}: must be" in stderr
    assert "Traceback" not in stderr


def test_sign_in_checks_are_awaited_off_the_event_loop_and_answer_right():
    """Gradio awaits an `auth` that is a coroutine function (and calls any other on its event loop):
    the app's check is one, and it tells right from wrong passwords and unknown users."""
    import asyncio
    import inspect

    from migration.service.accounts import Authenticator, hash_password

    auth = Authenticator({"alice": hash_password("pw-a", n=2**10), "bob": hash_password("pw-b", n=2**10)})
    assert inspect.iscoroutinefunction(auth.check)

    async def checks() -> list[bool]:
        return await asyncio.gather(auth.check("alice", "pw-a"), auth.check("alice", "pw-b"),
                                    auth.check("mallory", "pw-a"), auth.check("bob", "x" * 5000))
    assert asyncio.run(checks()) == [True, False, False, False]
