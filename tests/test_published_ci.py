"""Published measurements in the suite: one entry per model family and GPU of bench/published.json (Llama on
H100, H200 and B200, GPT on A100 and H100, bf16 and fp8), predicted from this product's compiled step as
bench/published_check.py does, against the step time the source published. Each error must lie within the
band the product states for such a step (steptime.EXPECTED_ERROR, EXPECTED_ERROR_FP8; README "Benchmarks")
and equal the error bench/results records for the entry (to its printed 0.1%), so that a change to the
HLO reader or the step-time model that moves an agreement fails here, not only in the bench.

The compiled programs are stored in tests/fixtures/published/ with the key of what built them (the entry's
configuration, the packages, the XLA flags, the model and step code): when the key is not this checkout's,
the program is compiled again in a separate process (the bench's environment), which is slower but checks the
same thing. `python bench/published_check.py --write-fixtures` stores this checkout's."""

import gzip
import importlib
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from migration.planning import steptime
from migration.planning.hlo_cost import read_program

ROOT = Path(__file__).resolve().parent.parent


def _import_bench(name: str = "bench.published_check"):
    """A bench module (bench/published_check.py, or bench/tpu_published.py, which imports it), imported with
    this process's environment left as it was (the bench sets its XLA and libtpu variables when imported)."""
    saved = dict(os.environ)
    try:
        module = importlib.import_module(name)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return module


@pytest.fixture(scope="module")
def published_check():
    return _import_bench()


def recorded_errors() -> dict[str, float]:
    """Each entry's error as bench/results records it (the published layout forced), in percent."""
    out = {}
    for name in ("published_check.json", "published_fp8_check.json"):
        record = json.loads((ROOT / "bench" / "results" / name).read_text())
        for row in record["tables"][0]["rows"]:
            out[row[0]] = float(row[-1].rstrip("%"))
    return out


def program(published_check, entry: dict, tmp_path: Path) -> str:
    text = published_check.stored_program(entry)
    if text is not None:
        return text
    warnings.warn(f"{entry['id']}: the stored program was built by other code or packages; compiling it again "
                  "(python bench/published_check.py --write-fixtures stores this checkout's)")
    done = subprocess.run([sys.executable, "bench/published_check.py", "--write-fixtures", str(tmp_path),
                           "--only", entry["id"]], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert done.returncode == 0, done.stderr[-3000:]
    text = published_check.stored_program(entry, tmp_path)
    assert text is not None, "the program compiled now does not carry this checkout's key"
    return text


def test_the_ci_entries_cover_each_family_gpu_and_precision(published_check):
    all_entries = {e["id"]: e for e in json.loads(published_check.PUBLISHED.read_text())}
    chosen = [all_entries[i] for i in published_check.CI_ENTRIES]
    assert {e["gpu"] for e in chosen} == {"h100-sxm", "a100-80gb", "h200", "b200"}
    assert {e["precision"] for e in chosen} == {"bf16", "fp8"}
    assert {e["model"]["mlp"] == "swiglu" for e in chosen} == {True, False}  # Llama and GPT
    assert {published_check.MAPPING[e["id"]][1] for e in chosen} == {"cudnn", "xla"}  # both attention kernels
    assert {published_check.MAPPING[e["id"]][3] for e in chosen} == {"tune", "held-out"}


@pytest.mark.parametrize("entry_id", _import_bench().CI_ENTRIES)
def test_a_published_step_is_predicted_within_the_stated_band(entry_id, published_check, tmp_path):
    entry = next(e for e in json.loads(published_check.PUBLISHED.read_text()) if e["id"] == entry_id)
    kernels = read_program(program(published_check, entry, tmp_path), per_node=published_check.per_node(entry))
    predicted = published_check.predict(entry, kernels, steptime.CALIBRATION).seconds
    published, how = published_check.published_step(entry)
    error = predicted / published - 1
    band = steptime.EXPECTED_ERROR_FP8 if entry["precision"] == "fp8" else steptime.EXPECTED_ERROR
    print(f"{entry_id}: published {published:.3f} s ({how}), predicted {predicted:.3f} s, error {error:+.1%} "
          f"(band ±{band:.0%})")
    assert abs(error) <= band, f"{entry_id}: {error:+.1%} is outside the stated ±{band:.0%}"
    recorded = recorded_errors()[entry_id]
    assert abs(100 * error - recorded) <= 0.051, (
        f"{entry_id}: the error is now {error:+.2%}, bench/results records {recorded:+.1f}%: if the change is meant, "
        "rerun `python bench/published_check.py --picked --json bench/results/published_check.json` (and --match fp8 "
        "for the fp8 record) and update README's figures")


# -- the TPU side: bench/published_check.py --tpu (bench/tpu_published.py) ---------------------------------------

def _import_tpu_bench():
    return _import_bench("bench.tpu_published")


def test_the_tpu_ci_entries_cover_each_generation_and_kind_of_job():
    tpu = _import_tpu_bench()
    chosen = [e for e in tpu.entries() if e["id"] in tpu.CI_ENTRIES]
    assert len(chosen) == len(tpu.CI_ENTRIES)
    assert {e["tpu"] for e in chosen} >= {"v4", "v5p", "v6e", "tpu7x"}
    assert {e["model"]["mlp"] for e in chosen} >= {"relu", "swiglu"}
    assert any(e["slices"] > 1 for e in chosen) and any("ici_tensor_parallelism" in e["parallelism"] for e in chosen)
    assert any(e["remat"].startswith("custom") for e in chosen)


@pytest.mark.parametrize("entry_id", _import_tpu_bench().CI_ENTRIES)
def test_a_published_tpu_step_is_predicted_as_the_bench_records_it(entry_id, tmp_path):
    """Each CI entry's stored TPU program (its kernels, compiled by libtpu for the published slices), predicted
    with the TPU calibration: within the band the product states for the TPU side, and the error bench/results
    records for it. Where the stored kernels are not this checkout's, the entry is compiled again here."""
    tpu = _import_tpu_bench()
    entry = next(e for e in tpu.entries() if e["id"] == entry_id)
    stored = tpu.stored_program(entry)
    if stored is None:
        warnings.warn(f"{entry_id}: the stored TPU program was built by other code or packages; compiling it again "
                      "(python bench/published_check.py --tpu --write-fixtures stores this checkout's)")
        done = subprocess.run([sys.executable, "bench/published_check.py", "--tpu", "--write-fixtures", str(tmp_path),
                               "--only", entry_id], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                              env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
        assert done.returncode == 0, done.stderr[-3000:]
        stored = tpu.stored_program(entry, tmp_path)
        assert stored is not None
    kernels, config, how = stored
    predicted = tpu.predict(entry, kernels, steptime.TPU_CALIBRATION).seconds
    published, _ = tpu.published_step(entry)
    error = predicted / published - 1
    assert abs(error) <= steptime.EXPECTED_ERROR_TPU, f"{entry_id}: {error:+.1%} ({how}, remat {config['remat']})"
    record = json.loads((ROOT / "bench" / "results" / "published_tpu_check.json").read_text())
    recorded = {row[0]: float(row[-1].rstrip("%")) for row in record["tables"][0]["rows"]}
    assert abs(100 * error - recorded[entry_id]) <= 0.051, (
        f"{entry_id}: the error is now {error:+.2%}, bench/results records {recorded[entry_id]:+.1f}%: rerun "
        "`python bench/published_check.py --tpu --json bench/results/published_tpu_check.json`")


def test_a_published_tpu_row_times_weight_gathers_as_all_gathers_only_where_its_recipe_runs_libtpus_flag():
    """Llama 3.1 70B on 64 TPU7x chips runs libtpu's default flags: its stored program's weight gathers
    (all-reduces of shards written into zeros) are timed as all-reduces. The same program for a recipe that
    runs --xla_tpu_prefer_async_allgather_to_allreduce=true sends each gather's bytes once round the ring, not
    twice. Each entry that states the flag is a TPU7x recipe whose pinned run_recipe.sh its notes cite."""
    from migration.planning.hlo_collectives import ALL_REDUCE_GATHER, PREFER_ALL_GATHER

    tpu = _import_tpu_bench()
    entry = next(e for e in tpu.entries() if e["id"] == "tpurecipes-tpu7x-llama3.1-70b-64chips-bf16")
    assert "libtpu_flags" not in entry
    text = gzip.decompress((tpu.FIXTURES / f"{entry['id']}.hlo.gz").read_bytes()).decode()
    kernels = tpu.read_kernels(entry, text)
    cal, links = steptime.TPU_CALIBRATION, tpu.links_for(entry)
    gathers = [k for k in kernels if k.kind == ALL_REDUCE_GATHER]
    assert gathers and not any(k.kind == "all-gather" for k in kernels)
    plain = tpu.predict(entry, kernels, cal)
    flagged = tpu.predict({**entry, "libtpu_flags": [PREFER_ALL_GATHER]}, kernels, cal)
    halved = sum(steptime.collective_seconds(k, links, cal) - cal.collective_s * k.count for k in gathers) / 2
    assert plain.communication_s - flagged.communication_s == pytest.approx(halved, rel=1e-9)
    assert flagged.compute_s == plain.compute_s
    stating = [e for e in tpu.entries() + _import_bench("bench.moe_published").entries() if e.get("libtpu_flags")]
    assert {e["id"] for e in stating} >= {"tpurecipes-tpu7x-deepseek3-671b-128chips-bf16",
                                          "tpurecipes-tpu7x-llama3.1-405b-256chips-bf16"}
    for e in stating:
        assert e["libtpu_flags"] == [PREFER_ALL_GATHER] and e["tpu"] == "tpu7x", e["id"]
        assert "/run_recipe.sh" in e["notes"] and re.search(r"/blob/[0-9a-f]{40}/", e["notes"]), e["id"]
