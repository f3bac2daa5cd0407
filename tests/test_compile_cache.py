"""The compile cache's key: a changed model, train step or policy never serves stale figures."""

import shutil
from pathlib import Path

from migration.memory import COMPILE_SOURCES, PROJECT_ROOT, code_fingerprint


def copy_sources(dest: Path) -> None:
    for pattern in COMPILE_SOURCES:
        for path in PROJECT_ROOT.glob(pattern):
            target = dest / path.relative_to(PROJECT_ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)


def test_the_fingerprint_changes_with_the_code_that_shapes_the_compile(tmp_path):
    copy_sources(tmp_path / "a")
    copy_sources(tmp_path / "b")
    assert code_fingerprint(tmp_path / "a") == code_fingerprint(tmp_path / "b") == code_fingerprint(PROJECT_ROOT)
    for i, changed in enumerate(["workloads/transformer.py", "migration/train.py", "migration/policies.py"]):
        root = tmp_path / f"changed{i}"
        copy_sources(root)
        (root / changed).write_text((root / changed).read_text() + "\n# a changed line\n")
        assert code_fingerprint(root) != code_fingerprint(PROJECT_ROOT), changed


def test_the_fingerprint_is_part_of_every_cache_key(monkeypatch, tmp_path):
    import migration.memory as memory
    from migration.config import PlanRequest

    req = PlanRequest(workload="transformer", preset="tiny", target="t4")
    predictor = memory.MemoryPredictor(req, lambda *a, **k: None, estimate_because="no compile in this test",
                                       cache=memory.CompileCache(tmp_path / "cache.json"))
    before = predictor._key("bf16", "none", 8, 1, "replicated")
    monkeypatch.setattr(memory, "code_fingerprint", lambda root=PROJECT_ROOT: "a-different-code-version")
    assert predictor._key("bf16", "none", 8, 1, "replicated") != before
