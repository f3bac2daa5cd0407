"""Raw form/API values -> configs: every bad value is a one-line ConfigError naming the field and the
value received; nothing is rounded or coerced. Code input (uploads, pastes) is refused the same way."""

import math

import pytest

from migration.config import forms
from migration.codecheck import (
    MAX_SOURCE_BYTES,
    CodeCheckError,
    check_pasted,
    check_source,
    check_sources,
    read_upload,
)
from migration.common import ConfigError
from migration.config.requests import PlanRequest, validate_plan_request

GOOD_PLAN = dict(workload="transformer", preset="tiny", source="tpu-v5e-8", global_batch=256, per_core_batch=0,
                 source_precision="bf16", target="h100-sxm", gpus=1, memory_fraction=0.8, granularity="multiple8",
                 remat="auto", precision="auto", accumulation=0)
GOOD_RUN = {"steps": 20, "learning_rate": 3e-3, "label": "baseline"}


def plan(**change):
    return forms.plan_request(**{**GOOD_PLAN, **change})


def run(max_steps=None, **change):
    return forms.run_settings(**{**GOOD_RUN, **change}, max_steps=max_steps)


# (call, field, text the message must quote back)
BAD = [
    # whole numbers
    (lambda: plan(global_batch=0), "global_batch", "0"),
    (lambda: plan(global_batch=-8), "global_batch", "-8"),
    (lambda: plan(global_batch=2_000_000), "global_batch", "2000000"),
    (lambda: plan(global_batch=10**400), "global_batch", "1000000000"),
    (lambda: plan(global_batch=256.5), "global_batch", "256.5"),
    (lambda: plan(global_batch=float("nan")), "global_batch", "nan"),
    (lambda: plan(global_batch=float("inf")), "global_batch", "inf"),
    (lambda: plan(global_batch=float("-inf")), "global_batch", "-inf"),
    (lambda: plan(global_batch=1e300), "global_batch", "1e+300"),
    (lambda: plan(global_batch="256.5"), "global_batch", "'256.5'"),
    (lambda: plan(global_batch="abc"), "global_batch", "'abc'"),
    (lambda: plan(global_batch=""), "global_batch", "''"),
    (lambda: plan(global_batch="1e3"), "global_batch", "'1e3'"),
    (lambda: plan(global_batch="٣٢"), "global_batch", "'٣٢'"),  # non-ASCII digits are not a number here
    (lambda: plan(global_batch=True), "global_batch", "True"),
    (lambda: plan(global_batch=None), "global_batch", "None"),
    (lambda: plan(global_batch=[256]), "global_batch", "[256]"),
    (lambda: plan(gpus=0), "gpus", "0"),
    (lambda: plan(gpus=65), "gpus", "65"),
    (lambda: plan(gpus=1.5), "gpus", "1.5"),
    (lambda: plan(per_core_batch=-1), "per_core_batch", "-1"),
    (lambda: plan(per_core_batch=31.5), "per_core_batch", "31.5"),
    (lambda: plan(per_core_batch=None), "per_core_batch", "None"),
    (lambda: plan(accumulation=-1), "accumulation_steps", "-1"),
    (lambda: plan(accumulation=2048), "accumulation_steps", "2048"),
    (lambda: plan(accumulation="two"), "accumulation_steps", "'two'"),
    # real numbers
    (lambda: plan(memory_fraction=0), "memory_fraction", "0"),
    (lambda: plan(memory_fraction=1.5), "memory_fraction", "1.5"),
    (lambda: plan(memory_fraction=float("nan")), "memory_fraction", "nan"),
    (lambda: plan(memory_fraction="nan"), "memory_fraction", "'nan'"),
    (lambda: plan(memory_fraction="80%"), "memory_fraction", "'80%'"),
    (lambda: plan(memory_fraction=False), "memory_fraction", "False"),
    (lambda: plan(memory_fraction=None), "memory_fraction", "None"),
    # unknown names
    (lambda: plan(workload="bert"), "workload", "'bert'"),
    (lambda: plan(preset="huge"), "preset", "'huge'"),
    (lambda: plan(workload="mlp", preset="gpt2-small"), "preset", "'gpt2-small'"),
    (lambda: plan(source="tpu-v9-8"), "source", "'tpu-v9-8'"),
    (lambda: plan(target="a200"), "target", "'a200'"),
    (lambda: plan(target=" h100-sxm"), "target", "' h100-sxm'"),
    (lambda: plan(source_precision="fp16"), "source_precision", "'fp16'"),
    (lambda: plan(granularity="pow3"), "granularity", "'pow3'"),
    (lambda: plan(remat="some"), "remat", "'some'"),
    (lambda: plan(precision="fp4"), "precision", "'fp4'"),
    (lambda: plan(precision=None), "precision", "None"),
    # contradictory combinations
    (lambda: plan(global_batch=16, per_core_batch=32), "per_core_batch", "32"),
    (lambda: plan(global_batch=256, per_core_batch=16), "per_core_batch", "16"),  # 16 × 8 cores = 128
    (lambda: plan(source="tpu-v4-8", global_batch=256, per_core_batch=32), "per_core_batch", "32"),  # 4 cores
    (lambda: plan(global_batch=100, per_core_batch=12), "per_core_batch", "12"),
    (lambda: plan(global_batch=16, gpus=4, accumulation=8), "accumulation_steps", "8"),
    (lambda: plan(global_batch=2, gpus=4, accumulation=1), "accumulation_steps", "1"),
    # run settings
    (lambda: run(steps=0), "steps", "0"),
    (lambda: run(steps=100_001), "steps", "100001"),
    (lambda: run(steps=20.5), "steps", "20.5"),
    (lambda: run(steps="twenty"), "steps", "'twenty'"),
    (lambda: run(steps=500_000, max_steps=1000), "steps", "500000"),
    (lambda: run(steps=1001, max_steps=1000), "steps", "1001"),
    (lambda: run(learning_rate=0), "learning_rate", "0"),
    (lambda: run(learning_rate=-1e-3), "learning_rate", "-0.001"),
    (lambda: run(learning_rate=2.0), "learning_rate", "2.0"),
    (lambda: run(learning_rate=float("inf")), "learning_rate", "inf"),
    (lambda: run(learning_rate="fast"), "learning_rate", "'fast'"),
    (lambda: run(learning_rate=True), "learning_rate", "True"),
    (lambda: run(label="x" * 81), "label", "81 characters"),
    (lambda: run(label="x" * 10_000), "label", "'xxxxxxxxxx"),
    (lambda: run(label="two\nlines"), "label", "'two\\nlines'"),
    (lambda: run(label="bell\x07"), "label", "'bell\\x07'"),
    (lambda: run(label="tab\there"), "label", "'tab\\there'"),
    (lambda: run(label="abc\u202edcba"), "label", "U+202E"),
    (lambda: run(label="para\u2029"), "label", "U+2029"),
    (lambda: run(label=None), "label", "None"),
    (lambda: run(label=42), "label", "42"),
]


@pytest.mark.parametrize("index", range(len(BAD)))
def test_bad_raw_values_are_refused_naming_the_field_and_the_value(index):
    call, field, shown = BAD[index]
    with pytest.raises(ConfigError) as err:
        call()
    message = str(err.value)
    assert err.value.field == field
    assert message.startswith(f"{field}: ") and shown in message and "\n" not in message, message
    assert len(message) < 400


def test_the_table_covers_enough_cases():
    assert len(BAD) >= 30


@pytest.mark.parametrize("raw", [256, 256.0, "256", " 256 ", "+256"])
def test_whole_numbers_in_any_honest_spelling_pass(raw):
    req = plan(global_batch=raw)
    assert req.global_batch == 256 and type(req.global_batch) is int


def test_good_plan_values_pass_with_the_app_conventions():
    req = plan()
    assert req == validate_plan_request(PlanRequest(global_batch=256, target="h100-sxm"))
    assert (req.per_core_batch, req.accumulation_steps, req.remat, req.precision) == (None, None, None, None)
    req = plan(per_core_batch=32.0, accumulation="2", remat="dots", precision="bf16", memory_fraction="0.5",
               gpus="2", source="tpu-v4-8", global_batch=128)
    assert (req.per_core_batch, req.accumulation_steps, req.remat, req.precision) == (32, 2, "dots", "bf16")
    assert (req.memory_fraction, req.gpus) == (0.5, 2)
    assert type(req.per_core_batch) is int and type(req.accumulation_steps) is int


def test_run_settings_parse_and_strip():
    assert forms.run_settings(20.0, "3e-3", "  my run  ") == (20, 3e-3, "my run")
    assert forms.run_settings("1000", 1, "", max_steps=1000) == (1000, 1.0, "")
    assert forms.run_settings(100_000, 1e-8, "é ✓ 日本", max_steps=10**9) == (100_000, 1e-8, "é ✓ 日本")


def test_per_user_step_limit_is_named():
    with pytest.raises(ConfigError) as err:
        forms.run_settings(500_000, 1e-3, "", max_steps=1000)
    assert str(err.value) == ("steps: must be a whole number from 1 to 1000 (this server's per-user limit); "
                              "got 500000")


def test_messages_read_as_documented():
    with pytest.raises(ConfigError) as err:
        forms.whole(256.5, "global_batch", 1, 1_048_576)
    assert str(err.value) == "global_batch: must be a whole number from 1 to 1048576; got 256.5"
    with pytest.raises(ConfigError, match=r"^per_core_batch: 16 per core × 8 cores of tpu-v5e-8 = 128, but "
                                          r"global_batch is 256 .*pmap.*; use per_core_batch 32"):
        plan(per_core_batch=16)


def test_helpers_directly():
    assert forms.whole("  7 ", "f", 1, 10) == 7 and forms.whole(-0.0, "f", 0, 1) == 0
    assert forms.number("1e-3", "f", 0, 1) == 1e-3 and forms.number(1, "f", 0, 1) == 1.0
    assert forms.number(10**400 // 10**399, "f", 0, 10) == 10.0
    assert forms.choice("a", "f", ("a", "b")) == "a"
    for bad in (10**400, -10**400, "9" * 5000, float("nan"), math.inf):
        with pytest.raises(ConfigError):
            forms.number(bad, "f", 0, 1)
        with pytest.raises(ConfigError):
            forms.whole(bad, "f", 0, 1)
    with pytest.raises(ConfigError, match=r"^f: must be one of a, b; got \['a'\]$"):
        forms.choice(["a"], "f", ("a", "b"))


def test_forms_module_imports_no_jax_or_gradio():
    import subprocess
    import sys

    code = "import sys, migration.config.forms; print('jax' in sys.modules, 'gradio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# -- code input --------------------------------------------------------------------------------------

def test_upload_of_non_utf8_bytes_is_refused_with_the_offset(tmp_path):
    path = tmp_path / "data.py"
    path.write_bytes(b"x =\xff 1\n")
    with pytest.raises(CodeCheckError) as err:
        read_upload(path)
    assert str(err.value) == "data.py: not UTF-8 text (byte 0xff at offset 3); upload Python source saved as UTF-8"
    bom = tmp_path / "bom.py"
    bom.write_bytes(b"\xef\xbb\xbfx = 1\xfe\n")
    with pytest.raises(CodeCheckError, match=r"byte 0xfe at offset 8"):
        read_upload(bom)


def test_upload_with_a_bom_reads_as_source(tmp_path):
    path = tmp_path / "win.py"
    path.write_bytes(b"\xef\xbb\xbfimport jax\nx = 1\n")
    name, text = read_upload(path)
    assert (name, text) == ("win.py", "import jax\nx = 1\n")
    check_sources([(name, text)])


def test_oversized_upload_is_refused_before_reading(tmp_path):
    path = tmp_path / "big.py"
    path.write_bytes(b"#" * (MAX_SOURCE_BYTES + 1))
    with pytest.raises(CodeCheckError) as err:
        read_upload(path)
    assert str(err.value) == "big.py: 1,000,001 bytes; the limit is 1,000,000 bytes per file"


def test_wrong_extension_and_missing_file_are_refused(tmp_path):
    for name in ("notes.txt", "script.PY", "archive.py.zip", "noext"):
        path = tmp_path / name
        path.write_text("x = 1\n")
        with pytest.raises(CodeCheckError, match=rf"^{name}: only \.py files"):
            read_upload(path)
    with pytest.raises(CodeCheckError, match=r"^gone\.py: could not be read"):
        read_upload(tmp_path / "gone.py")


def test_null_byte_is_a_code_check_error_everywhere(tmp_path):
    with pytest.raises(CodeCheckError, match=r"^<pasted>: contains a null byte \(line 2\)"):
        check_source("x = 1\ny = '\0'\n")
    with pytest.raises(CodeCheckError, match=r"^pasted code: contains a null byte"):
        check_pasted("\0")
    path = tmp_path / "nul.py"
    path.write_bytes(b"x = 1\x00\n")
    with pytest.raises(CodeCheckError, match=r"^nul\.py: contains a null byte \(line 1\)"):
        read_upload(path)


def test_oversized_paste_is_refused_by_check_pasted_and_check_sources():
    text = "#" * 1_200_000
    with pytest.raises(CodeCheckError) as err:
        check_pasted(text)
    assert str(err.value) == "pasted code: 1,200,000 bytes; the limit is 1,000,000 bytes per file"
    with pytest.raises(CodeCheckError, match=r"^a\.py: 1,200,000 bytes; the limit is 1,000,000"):
        check_sources([("ok.py", "x = 1\n"), ("a.py", text)])
    # multi-byte characters count as bytes, not characters
    with pytest.raises(CodeCheckError, match="1,000,002 bytes"):
        check_pasted("é" * 500_001)
    assert check_pasted("x = 1\n") == "x = 1\n"


def test_text_that_is_not_source_is_a_code_check_error():
    for bad in ("x = '\ud800'\n", "\ufeffx = 1\n", "def f(:\n"):
        with pytest.raises(CodeCheckError):
            check_source(bad)
    with pytest.raises(CodeCheckError, match="expected Python source as text; got bytes"):
        check_sources([("b.py", b"x = 1")])
