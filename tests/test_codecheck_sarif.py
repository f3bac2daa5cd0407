"""The code check's SARIF output (`python -m migration.codecheck --format sarif`) against the official
SARIF 2.1.0 JSON schema, and what GitHub code scanning needs beyond the schema.

The schema, tests/fixtures/codecheck/sarif-schema-2.1.0.json, is the OASIS Static Analysis Results
Interchange Format (SARIF) Version 2.1.0 JSON schema (JSON Schema draft-07; `$id`
https://raw.githubusercontent.com/oasis-tcs/sarif-spec/master/Schemata/sarif-schema-2.1.0.json, the
same 2.1.0 schema json.schemastore.org/sarif-2.1.0.json serves), kept byte for byte as OASIS published
it in the SARIF TC's repository:

    repository  https://github.com/oasis-tcs/sarif-spec
    path        Schemata/sarif-schema-2.1.0.json
    commit      5280a944e8faa17a60ab15917a5449e27ed5b32c (2020-03-04, "Update 'latest' schema to match
                version submitted in call for consent", i.e. the OASIS Standard 2.1.0 schema)
    size        115,632 bytes (CRLF line ends), sha256 ad6db49878699b091f3eeb765b6e29e92a34bad4da88664d000c923b549c3a25

The schema is a normative part of the OASIS Standard SARIF v2.1.0, Copyright (c) OASIS Open 2020.
The repository's LICENSE.md puts its content under the OASIS policies (IPR Policy, RF on RAND mode),
and the OASIS copyright notice lets the standard be copied and furnished to others; the file itself
carries no notice, so this one goes with it here.
Later copies in that repository differ: the approved errata (sarif-2.1/schema/, errata01) went back
to draft-04, and the 2.2 workplace copy (sarif-2.1/prose/) renames suppression.status to `state`.

The linter runs as a subprocess, as a CI job would run it; its SARIF is validated with
jsonschema's Draft7Validator (format assertions are not checked by it, so the relative-URI form of
artifactLocation.uri is checked by hand below).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "codecheck"
SCHEMA_PATH = FIXTURES / "sarif-schema-2.1.0.json"
SCHEMA_SHA256 = "ad6db49878699b091f3eeb765b6e29e92a34bad4da88664d000c923b549c3a25"
REAL = FIXTURES / "real"
# a relative reference of RFC 3986 (path only): unreserved, percent-encoded, sub-delims, ':' '@' '/'
RELATIVE_URI = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-Fa-f]{2})+")


def lint_sarif(*paths: str | Path) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "migration.codecheck", "--format", "sarif", *map(str, paths)],
                          check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr  # 1: findings at or above --fail-on; 2 would be a broken run
    return proc, json.loads(proc.stdout)


def schema_errors(validator: jsonschema.Draft7Validator, log: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(log), key=lambda e: list(map(str, e.absolute_path)))]


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def corpus_log() -> dict:
    proc, log = lint_sarif(REAL.relative_to(ROOT))
    assert proc.returncode == 1, "the real corpus has error-level findings"
    return log


def test_the_schema_is_the_oasis_sarif_2_1_0_schema_kept_byte_for_byte():
    data = SCHEMA_PATH.read_bytes()
    assert hashlib.sha256(data).hexdigest() == SCHEMA_SHA256
    schema = json.loads(data)
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert schema["title"] == "Static Analysis Results Format (SARIF) Version 2.1.0 JSON Schema"
    assert schema["properties"]["version"]["enum"] == ["2.1.0"] and schema["required"] == ["version", "runs"]
    for name in ("run", "tool", "toolComponent", "result", "reportingDescriptor", "location",
                 "physicalLocation", "artifactLocation", "region", "message"):
        assert name in schema["definitions"], name


def test_sarif_of_the_real_corpus_validates_against_the_schema(validator, corpus_log):
    errors = schema_errors(validator, corpus_log)
    assert errors == [], f"{len(errors)} schema error(s), first ones:\n" + "\n".join(errors[:10])
    assert corpus_log["version"] == "2.1.0" and len(corpus_log["runs"]) == 1
    assert len(corpus_log["runs"][0]["results"]) > 0


def test_sarif_without_findings_validates_and_has_no_results(validator, tmp_path):
    clean = tmp_path / "clean.py"
    clean.write_text("import jax\nimport jax.numpy as jnp\n\n\n@jax.jit\ndef total(x):\n    return jnp.sum(x)\n",
                     encoding="utf-8")
    proc, log = lint_sarif(clean)
    assert proc.returncode == 0, proc.stdout
    errors = schema_errors(validator, log)
    assert errors == [], "\n".join(errors[:10])
    assert log["runs"][0]["results"] == []
    assert log["runs"][0]["tool"]["driver"]["rules"], "the rule table is written even with no findings"


@pytest.mark.parametrize("corrupt", [
    pytest.param(lambda log: log["runs"][0]["results"][0].update(level="fatal"), id="unknown-level"),
    pytest.param(lambda log: log["runs"][0]["tool"]["driver"].pop("name"), id="driver-without-name"),
    pytest.param(lambda log: log["runs"][0]["results"][0].pop("message"), id="result-without-message"),
    pytest.param(lambda log: log["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["region"]
                 .update(startLine=0), id="line-zero"),
    pytest.param(lambda log: log.update(version="2.0.0"), id="wrong-version"),
    pytest.param(lambda log: log["runs"][0]["results"][0].update(severity="error"), id="unknown-property"),
])
def test_the_validator_rejects_a_broken_log(validator, corpus_log, corrupt):
    broken = copy.deepcopy(corpus_log)
    corrupt(broken)
    assert schema_errors(validator, broken) != []


def test_results_carry_what_github_code_scanning_needs(corpus_log):
    driver = corpus_log["runs"][0]["tool"]["driver"]
    assert driver["name"]
    rules = driver["rules"]
    ids = [rule["id"] for rule in rules]
    assert len(ids) == len(set(ids)), "rule ids are unique"
    for rule in rules:
        assert rule["shortDescription"]["text"] and rule["defaultConfiguration"]["level"] in ("error", "warning", "note")
    results = corpus_log["runs"][0]["results"]
    assert results
    for result in results:
        assert result["ruleId"] in ids, result
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"], result
        assert result["level"] in ("error", "warning", "note") and result["message"]["text"].strip()
        assert result["locations"], result
        for location in result["locations"]:
            physical = location["physicalLocation"]
            uri = physical["artifactLocation"]["uri"]
            assert not uri.startswith("/") and "\\" not in uri, uri
            assert RELATIVE_URI.fullmatch(uri) and ":" not in uri.split("/")[0], f"not a relative URI: {uri!r}"
            assert (ROOT / uri).is_file() and (ROOT / uri).parent == REAL, uri
            region = physical["region"]
            assert isinstance(region["startLine"], int) and region["startLine"] >= 1, result
            assert region.get("startColumn", 1) >= 1, result
    assert {r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in results} <= {
        path.relative_to(ROOT).as_posix() for path in REAL.glob("*.py")}


def test_a_path_with_spaces_is_a_valid_relative_uri_and_one_outside_an_absolute_file_uri(validator, tmp_path):
    inside = tmp_path / "repo" / "my scripts"
    inside.mkdir(parents=True)
    (inside / "train step.py").write_text("import jax\nx = jax.tree_map(f, y)\n")
    outside = tmp_path / "elsewhere.py"
    outside.write_text("import jax\nx = jax.tree_map(f, y)\n")
    out = subprocess.run([sys.executable, "-m", "migration.codecheck", "--format", "sarif", "my scripts", str(outside)],
                         capture_output=True, text=True, cwd=inside.parent, env={"PYTHONPATH": str(ROOT)})
    log = json.loads(out.stdout)
    assert schema_errors(validator, log) == []
    locations = [r["locations"][0]["physicalLocation"]["artifactLocation"] for r in log["runs"][0]["results"]]
    assert {"uri": "my%20scripts/train%20step.py", "uriBaseId": "SRCROOT"} in locations
    assert {"uri": outside.resolve().as_uri()} in locations
    assert log["runs"][0]["originalUriBaseIds"]["SRCROOT"]["uri"] == inside.parent.resolve().as_uri() + "/"
