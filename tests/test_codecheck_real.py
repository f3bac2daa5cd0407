"""The code check on real public TPU-era JAX training scripts (tests/fixtures/codecheck/real/).

74 scripts from 68 repositories (2020-2023), in four batches (22 from 16, then 20, 17 and 15 from as many more),
kept byte for byte with their repository, path, commit and licence in MANIFEST.json (licence texts in LICENSES/), labelled
by reading them before any check ran on them. A third of each batch (every third file of the batch by name,
chosen before labelling) is held out: rules are not changed after looking at it, and its figures are reported
apart.

Labels use the rule ids of migration/codecheck/rules.py, plus ids for problems no rule finds yet (PMAP003
pmap-era placement helpers, GCS001 Cloud Storage paths, TPUENV001 TPU-only environment, TOPO001 hard-coded TPU
topologies, BF16OPT001 bfloat16 optimizer state); REMOVED003 labels names the rule table lists under
REMOVED001 (jax.ShapedArray, jax.spmd_mode, flax.nn, flax.optim, ...) and are scored as REMOVED001. A removed
module or name is labelled where it is imported (that line fails first); later uses of the imported name are
not labelled again, while each use of a removed name written out in full (`jax.tree_map`, `flax.optim.Adam`)
is. `python -m pytest tests/test_codecheck_real.py -s` prints per-rule precision and recall for each part and
the labels no rule covers.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from migration.codecheck import RULES, check_source

REAL = Path(__file__).resolve().parent / "fixtures" / "codecheck" / "real"
MANIFEST = json.loads((REAL / "MANIFEST.json").read_text())
ALIASES = {"REMOVED003": "REMOVED001"}  # labelled apart, listed under REMOVED001 by the rule table
BATCHES = (1, 2, 3, 4)  # labelled and added in this order
REDISTRIBUTABLE = {"Apache-2.0", "MIT", "BSD-2-Clause", "BSD-3-Clause"}


def test_every_script_is_kept_with_its_source_and_a_licence_that_allows_it():
    assert len(MANIFEST) >= 40 and len({e["repo"] for e in MANIFEST}) >= 25
    for entry in MANIFEST:
        assert (REAL / entry["file"]).is_file(), entry["file"]
        assert re.fullmatch(r"[0-9a-f]{40}", entry["commit"]) and entry["repo"] in entry["url"]
        assert entry["licence"] in REDISTRIBUTABLE, entry
        assert (REAL / "LICENSES" / (entry["repo"].replace("/", "__") + ".txt")).is_file(), entry["repo"]
        assert entry["split"] in ("tune", "held-out") and entry["batch"] in BATCHES
        lines = (REAL / entry["file"]).read_text(encoding="utf-8").count("\n") + 1
        assert all(1 <= label["line"] <= lines for label in entry["labels"]), entry["file"]
    # the held-out third of each batch was chosen by name before labelling: every third file of the
    # batch in sorted order (a later batch never moves an earlier one's files between the parts)
    for batch in BATCHES:
        names = sorted(e["file"] for e in MANIFEST if e["batch"] == batch)
        held = {e["file"] for e in MANIFEST if e["split"] == "held-out" and e["batch"] == batch}
        assert held == {name for i, name in enumerate(names) if i % 3 == 2}


def score(split: str) -> tuple[dict[str, Counter], Counter]:
    """Per rule: true positives, false alarms, misses (as (file, line, rule)); and the labels whose
    problem no rule covers yet, by id."""
    per_rule: dict[str, Counter] = {}
    uncovered: Counter = Counter()
    for entry in (e for e in MANIFEST if e["split"] == split):
        text = (REAL / entry["file"]).read_text(encoding="utf-8")
        expected = set()
        for label in entry["labels"]:
            rule = ALIASES.get(label["rule"], label["rule"])
            if rule in RULES:
                expected.add((label["line"], rule))
            else:
                uncovered[rule] += 1
        found = {(f.line, f.rule) for f in check_source(text, entry["file"]) if f.rule != "IGNORE001"}
        for line, rule in expected | found:
            counts = per_rule.setdefault(rule, Counter())
            counts["tp" if (line, rule) in expected and (line, rule) in found
                   else "fn" if (line, rule) in expected else "fp"] += 1
    return per_rule, uncovered


def table(split: str) -> str:
    per_rule, uncovered = score(split)
    rows = [f"{split}: rule          TP   FP   FN precision  recall"]
    total = Counter()
    for rule, c in sorted(per_rule.items()):
        total.update(c)
        rows.append(_row(rule, c))
    rows.append(_row("overall", total))
    rows.append("labels no rule covers yet: " + (", ".join(f"{r} {n}" for r, n in sorted(uncovered.items())) or "none"))
    return "\n".join(rows)


def _row(name: str, c: Counter) -> str:
    precision = c["tp"] / (c["tp"] + c["fp"]) if c["tp"] + c["fp"] else 1.0
    recall = c["tp"] / (c["tp"] + c["fn"]) if c["tp"] + c["fn"] else 1.0
    return f"{name:<20} {c['tp']:>4} {c['fp']:>4} {c['fn']:>4} {precision:>9.3f} {recall:>7.3f}"


# Floors under the figures measured on each part (README, "The code check"): the tuning part meets the
# goal (precision >= 0.97, recall >= 0.95); the held-out part does not (0.947 / 0.903 over the 24 held-out
# files of four batches when the rules last changed), and its floor only keeps it from getting worse.
FLOORS = {"tune": (0.97, 0.95), "held-out": (0.94, 0.89)}


@pytest.mark.parametrize("split", ["tune", "held-out"])
def test_the_check_is_scored_on_each_part(split):
    """The per-rule figures are printed (with -s); the overall precision and recall must stay above the
    part's floor."""
    per_rule, _ = score(split)
    assert sum(c["tp"] + c["fn"] for c in per_rule.values()) > 20
    print("\n" + table(split))
    total = sum(per_rule.values(), Counter())
    precision = total["tp"] / (total["tp"] + total["fp"])
    recall = total["tp"] / (total["tp"] + total["fn"])
    assert precision >= FLOORS[split][0] and recall >= FLOORS[split][1], (precision, recall)
