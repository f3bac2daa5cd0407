"""bench/removed_api_candidates.py: the changelog parser and the classification of the names it finds,
on a small changelog written in the style of JAX's CHANGELOG.md (no network)."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "removed_api_candidates.py"

CHANGELOG = """\
# Change log

Best viewed [here](https://docs.jax.dev/en/latest/changelog.html).

## Unreleased

* Deprecations
  * `jax.experimental.fictional_deprecated` is deprecated and will be removed in
    JAX v0.12.0. Use `jax.jit` instead.

## JAX 0.6.0 (April 16, 2025)

* Breaking changes
  * `jax.experimental.fictional_api` has been removed. Use {func}`jax.vmap`
    instead.
  * `jax.jit` no longer accepts `None` for `static_argnums`; that behaviour
    has been removed.
  * Several previously-deprecated APIs have been removed, including:
    * From `jax`: `jax.tree_map`, and `jax.tree_leaves`.
    * From {mod}`jax.experimental`: `fictional_helper`.

## jax 0.4.26 (April 3, 2024)

* Deletions
  * `in_axis_resources` and `out_axis_resources` have been deleted from pjit.
    Please use `in_shardings` and `out_shardings` as the replacement.
  * The deprecated keyword argument `fictional_kw` to `jax.numpy.clip` has been removed.

## jaxlib 0.4.1 (Dec 13, 2022)

* `jnp.fictional_alias` has been removed.

## jax (0.2.0) (September 23 2020)

* `jax.experimental.ancient_api` was removed.
"""


@functools.cache
def load_script():
    """The script as a module (bench/ is no package); registered first, as its dataclasses need."""
    spec = importlib.util.spec_from_file_location("removed_api_candidates", SCRIPT)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, dict]:
    path = tmp_path_factory.mktemp("changelog") / "CHANGELOG.md"
    path.write_text(CHANGELOG)
    done = subprocess.run([sys.executable, str(SCRIPT), str(path), "--since", "0.4.0", "--format", "json"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["summary"].startswith(f"{len(report['candidates'])} names")
    return {row["label"]: row for row in report["candidates"]}


def test_a_removed_name_missing_from_jax_and_from_removed_is_a_candidate_and_comes_first(rows):
    row = rows["jax.experimental.fictional_api"]
    assert (row["status"], row["version"], row["installed"], row["in_removed"]) == ("removed", "0.6.0", "absent", False)
    assert "has been removed" in row["line"]
    # the removals to add lead the list, the oldest first
    assert list(rows)[:4] == ["jax.numpy.fictional_alias", "jax.numpy.clip(fictional_kw=)",
                              "jax.experimental.fictional_api", "jax.experimental.fictional_helper"]


def test_names_listed_under_a_removal_bullet_are_qualified_by_their_module(rows):
    assert rows["jax.experimental.fictional_helper"]["status"] == "removed"
    assert rows["jax.experimental.fictional_helper"]["installed"] == "absent"
    assert rows["jax.numpy.fictional_alias"]["version"] == "0.4.1"  # jnp. read as jax.numpy.


def test_names_already_in_removed_are_marked(rows):
    for name in ("jax.tree_map", "jax.tree_leaves"):
        assert (rows[name]["status"], rows[name]["in_removed"], rows[name]["installed"]) == ("removed", True, "absent")


def test_a_name_still_in_jax_is_reported_present_and_last(rows):
    assert (rows["jax.jit"]["status"], rows["jax.jit"]["installed"], rows["jax.jit"]["in_removed"]) == (
        "removed", "present", False)
    assert list(rows)[-1] == "jax.jit"


def test_a_deprecation_without_removal_is_kept_as_deprecated_after_the_removals(rows):
    row = rows["jax.experimental.fictional_deprecated"]
    assert (row["status"], row["version"], row["installed"]) == ("deprecated", "unreleased", "absent")
    labels = list(rows)
    assert labels.index("jax.experimental.fictional_helper") < labels.index("jax.experimental.fictional_deprecated")


def test_keywords_are_reported_with_their_function(rows):
    assert rows["pjit(in_axis_resources=)"]["in_removed"] and rows["pjit(out_axis_resources=)"]["in_removed"]
    assert rows["jax.numpy.clip(fictional_kw=)"]["installed"] == "absent"


def test_replacements_and_old_versions_are_left_out(rows):
    assert not {"jax.vmap", "pjit(in_shardings=)", "pjit(out_shardings=)"} & set(rows)
    assert "jax.experimental.ancient_api" not in rows  # 0.2.0 is before --since 0.4.0


@pytest.mark.parametrize("heading, version", [
    ("## jax 0.4.26 (April 3, 2024)", "0.4.26"),
    ("## JAX 0.5.0", "0.5.0"),
    ("## JAX 0.10.2 (June 17, 2026)", "0.10.2"),
    ("## jaxlib 0.4.32 (September 11, 2024)", "0.4.32"),
    ("## jax (0.2.0) (September 23 2020)", "0.2.0"),
    ("## Unreleased", "unreleased"),
    ("### Notable bug fixes", None),
    ("## Change log", None),
])
def test_section_headings_give_their_version(heading, version):
    assert load_script().heading_version(heading) == version


def test_sections_entries_and_statuses_are_parsed_from_the_text():
    script = load_script()
    sections = dict(script.sections(CHANGELOG))
    assert list(sections) == ["unreleased", "0.6.0", "0.4.26", "0.4.1", "0.2.0"]
    nested = [e for e in script.entries("0.6.0", sections["0.6.0"]) if e.text.startswith("From `jax`")]
    assert nested[0].parents[0].startswith("Several previously-deprecated APIs have been removed")
    assert [script.classify(text) for text in ("X has been removed.", "X is deprecated and will be removed.",
                                               "X no longer available.", "Faster compiles.")] == [
        "removed", "deprecated", "removed", None]
    assert sorted(script.version_key(v) for v in ("unreleased", "0.10.0", "0.4.26")) == [(0, 4, 26), (0, 10, 0),
                                                                                       (10**6,)]


@pytest.mark.parametrize("args, message", [
    (["missing.md"], "missing.md: no such file"),
    (["{changelog}", "--flax", "missing.md"], "missing.md: no such file"),
    (["{changelog}", "--write", "{tmp}/no/such/folder/out.py"], "its folder does not exist"),
    (["{changelog}", "--write", "{tmp}"], "cannot be written"),
])
def test_a_missing_changelog_or_an_unwritable_table_is_refused_with_a_message(tmp_path, args, message):
    changelog = tmp_path / "CHANGELOG.md"
    changelog.write_text(CHANGELOG)
    argv = [a.format(changelog=changelog, tmp=tmp_path) for a in args]
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], check=False, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("runs", ["0", "-3", "many", "1000"])
def test_the_speed_bench_refuses_a_run_count_outside_its_range(runs):
    script = SCRIPT.parent / "codecheck_speed.py"
    done = subprocess.run([sys.executable, str(script), "--runs", runs], check=False, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--runs" in done.stderr and "Traceback" not in done.stderr, done.stderr
