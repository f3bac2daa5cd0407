"""The code check as a linter: `python -m migration.codecheck PATH...` (standard library only, so it
runs in a pre-commit hook or a CI job where JAX is not installed).

- PATH: files or folders (folders are searched for `*.py`, skipping hidden folders, virtual
  environments, `__pycache__`, `build`, `dist` and `node_modules`).
- `--format`: `text` (default), `json`, `sarif` (SARIF 2.1.0, for GitHub code scanning) or `github`
  (workflow annotations); `--output FILE` writes it there instead of standard output.
- `--select` / `--ignore`: comma-separated rule ids or prefixes (`PMAP` is PMAP001 and PMAP002), as
  ruff takes them; also read from `[tool.migration-check]` (`select`, `ignore`, `exclude` lists) in
  the nearest `pyproject.toml` above the working folder; flags win.
- `--fail-on`: the least severity that fails the check (`error` by default; `warning`, `info`).
- `--fix`: rewrite in place what is mechanical and safe (REMOVED001 aliases with a drop-in successor,
  PJIT001 keywords, ENV001 settings moved before the JAX import; codecheck/fix.py, needs LibCST),
  then report what is left; `--diff`: print those rewrites as a unified diff and change nothing.

Exit codes: 0 no finding at or above `--fail-on`; 1 such findings (with `--diff`: 1 when there is
something to fix); 2 a path could not be read or checked (too large, not Python, not UTF-8), the
command line is wrong, or `--fix` / `--diff` without LibCST (the other files are still checked and
reported).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tomllib
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from migration import version
from migration.codecheck.engine import analyse
from migration.codecheck.fix import FixResult, fix_source
from migration.codecheck.findings import CodeCheckError, Finding
from migration.codecheck.inputs import read_source
from migration.codecheck.rules import RULES, SEVERITIES

FORMATS = ("text", "json", "sarif", "github")
SKIPPED_FOLDERS = {"__pycache__", "build", "dist", "node_modules", "site-packages", "venv"}
CONFIG_TABLE = "migration-check"
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
SARIF_LEVEL = {"error": "error", "warning": "warning", "info": "note"}
TOOL_NAME = "migration-check"


def python_files(paths: Iterable[str], exclude: Sequence[str] = ()) -> tuple[list[Path], list[str]]:
    """The .py files under `paths` (sorted, each once), and the paths that do not exist."""
    found: dict[Path, None] = {}
    missing = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            for root, folders, files in os.walk(path):
                folders[:] = sorted(f for f in folders if not f.startswith(".") and f not in SKIPPED_FOLDERS
                                    and not _excluded(Path(root, f), exclude))
                found.update((Path(root, f), None) for f in sorted(files)
                             if f.endswith(".py") and not _excluded(Path(root, f), exclude))
        elif path.exists():
            found[path] = None
        else:
            missing.append(raw)
    return list(found), missing


def _excluded(path: Path, exclude: Sequence[str]) -> bool:
    return any(path.match(pattern) or pattern in path.parts for pattern in exclude)


def chosen_rules(select: Sequence[str], ignore: Sequence[str]) -> set[str]:
    """Rule ids kept: those matching a `select` prefix (all when none), less those matching `ignore`."""
    def matches(rule: str, prefixes: Sequence[str]) -> bool:
        return any(rule.startswith(p.strip().upper()) for p in prefixes if p.strip())
    return {r for r in RULES if (not select or matches(r, select)) and not matches(r, ignore)}


def read_config(start: Path) -> dict[str, list[str]]:
    """`[tool.migration-check]` of the nearest pyproject.toml at or above `start` ({} when none)."""
    for folder in (start, *start.parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            try:
                table = tomllib.loads(candidate.read_text(encoding="utf-8")).get("tool", {}).get(CONFIG_TABLE, {})
            except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as exc:
                raise CodeCheckError(f"{candidate}: cannot read [tool.{CONFIG_TABLE}] ({exc})") from None
            return _checked_table(table, candidate)
    return {}


CONFIG_KEYS = ("select", "ignore", "exclude")


def _checked_table(table: object, where: Path) -> dict[str, list[str]]:
    """The table's lists of strings; CodeCheckError naming a key that is unknown or not a list of strings."""
    if not isinstance(table, dict):
        raise CodeCheckError(f"{where}: [tool.{CONFIG_TABLE}] must be a table")
    unknown = sorted(set(table) - set(CONFIG_KEYS))
    if unknown:
        raise CodeCheckError(f"{where}: [tool.{CONFIG_TABLE}] has no key {unknown[0]!r}; the keys are "
                             f"{', '.join(CONFIG_KEYS)}")
    for key, value in table.items():
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise CodeCheckError(f"{where}: [tool.{CONFIG_TABLE}] {key} must be a list of strings, e.g. "
                                 f"{key} = [\"PMAP\"]; got {value!r}"[:300])
    return {k: list(v) for k, v in table.items()}


def check(files: Sequence[Path], rules: set[str],
          after_each: Callable[[], object] = lambda: None) -> tuple[list[Finding], list[str]]:
    """Findings of the kept rules in every file, and one message per file that could not be checked;
    `after_each` runs after each file (the linter frees the file's trees there)."""
    findings, problems = [], []
    for path in files:
        try:
            name, text = read_source(path)
            findings += [f for f in analyse(text, name).findings if f.rule in rules]
        except (CodeCheckError, OSError) as exc:
            problems.append(str(exc))
        after_each()
    return findings, problems


# -- output formats ----------------------------------------------------------------------------

def as_text(findings: Sequence[Finding], files: int) -> str:
    lines = [f"{f.file}:{f.line}:{f.col}: {f.severity} {f.rule} {f.message}\n    write instead: {f.replacement}"
             for f in findings]
    counts = {sev: sum(f.severity == sev for f in findings) for sev in SEVERITIES}
    lines.append(f"{len(findings)} finding(s) in {files} file(s)"
                 + (": " + ", ".join(f"{n} {sev}" for sev, n in counts.items() if n) if findings else ""))
    return "\n".join(lines) + "\n"


def as_json(findings: Sequence[Finding], files: int) -> str:
    return json.dumps([f.to_dict() for f in findings], indent=2) + "\n"


def as_github(findings: Sequence[Finding], files: int) -> str:
    """GitHub Actions workflow commands: one annotation per finding."""
    def escape(text: str, prop: bool = False) -> str:
        text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
        return text.replace(":", "%3A").replace(",", "%2C") if prop else text
    level = {"error": "error", "warning": "warning", "info": "notice"}
    return "".join(f"::{level[f.severity]} file={escape(f.file, True)},line={f.line},col={f.col},"
                   f"title={escape(f.rule + ' ' + RULES[f.rule].title, True)}::{escape(f.message)}\n"
                   for f in findings)


def as_sarif(findings: Sequence[Finding], files: int) -> str:
    """SARIF 2.1.0: one run, the rule table as the driver's rules, one result per finding."""
    ids = sorted(RULES)
    rules = [{"id": r, "name": RULES[r].title, "shortDescription": {"text": RULES[r].title},
              "fullDescription": {"text": RULES[r].rationale}, "help": {"text": RULES[r].replacement},
              "defaultConfiguration": {"level": SARIF_LEVEL[RULES[r].severity]}} for r in ids]
    results = [{"ruleId": f.rule, "ruleIndex": ids.index(f.rule), "level": SARIF_LEVEL[f.severity],
                "message": {"text": f"{f.message}. Write instead: {f.replacement}"},
                "locations": [{"physicalLocation": {
                    "artifactLocation": sarif_location(f.file),
                    "region": {"startLine": max(1, f.line), "startColumn": max(1, f.col)}}}]}
               for f in findings]
    log = {"$schema": SARIF_SCHEMA, "version": "2.1.0",
           "runs": [{"tool": {"driver": {"name": TOOL_NAME, "rules": rules}},
                     "originalUriBaseIds": {"SRCROOT": {"uri": Path.cwd().resolve().as_uri() + "/"}},
                     "results": results}]}
    return json.dumps(log, indent=2) + "\n"


def sarif_location(file: str) -> dict[str, str]:
    """A file under the working folder as a percent-encoded URI relative to it (SRCROOT, so that code
    scanning maps it to the repository); any other as an absolute file:// URI."""
    path = Path(file).resolve()
    try:
        relative = path.relative_to(Path.cwd().resolve())
    except ValueError:
        return {"uri": path.as_uri()}
    return {"uri": urllib.parse.quote(relative.as_posix(), safe="/"), "uriBaseId": "SRCROOT"}


WRITERS = {"text": as_text, "json": as_json, "sarif": as_sarif, "github": as_github}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m migration.codecheck",
                                description="Read Python files (never run them) for TPU-specific or outdated JAX.")
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or folders (searched for *.py)")
    p.add_argument("--format", choices=FORMATS, default="text")
    p.add_argument("--output", metavar="FILE", help="write the report here instead of standard output")
    p.add_argument("--select", default=None, help="comma-separated rule ids or prefixes to check (default: all)")
    p.add_argument("--ignore", default=None, help="comma-separated rule ids or prefixes not to check")
    p.add_argument("--fail-on", choices=SEVERITIES, default="error",
                   help="the least severity that makes the exit status 1 (default: error)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--fix", action="store_true", help="rewrite the mechanical fixes in place, then report the rest")
    how.add_argument("--diff", action="store_true", help="print the mechanical fixes as a diff; change nothing")
    return p


def apply_fixes(files: Sequence[Path], rules: set[str], write: bool,
                after_each: Callable[[], object] = lambda: None) -> tuple[list[FixResult], list[str]]:
    """Fix every file (written back when `write`); the results that changed something, and problems.
    `after_each` runs after each file, as in `check`."""
    changed, problems = [], []
    for path in files:
        try:
            name, text = read_source(path)
            result = fix_source(text, name, rules)
        except (CodeCheckError, OSError, SyntaxError) as exc:
            problems.append(str(exc))
            if "LibCST" in str(exc):
                break
            continue
        finally:
            after_each()
        if result.changed:
            changed.append(result)
            if write:
                try:
                    path.write_bytes(result.after.encode("utf-8"))
                except OSError as exc:  # the file stays as it was; the others are still fixed
                    problems.append(f"{path}: could not be written ({exc.strerror or type(exc).__name__})")
                    changed.pop()
    return changed, problems


def fix_summary(results: Sequence[FixResult], write: bool) -> str:
    counts = sum((r.fixed for r in results), Counter())
    verb = "fixed" if write else "would fix"
    per_rule = ", ".join(f"{rule} {n}" for rule, n in sorted(counts.items()))
    return f"{verb} {sum(counts.values())} finding(s) in {len(results)} file(s)" + (f": {per_rule}" if per_rule else "")


def main(argv: Sequence[str] | None = None) -> int:
    # Many small AST objects are built and dropped: automatic collections spend about a sixth of a run
    # traversing trees still in use (mypy raises the thresholds for the same reason). Instead, what is
    # loaded by now is set aside (`gc.freeze`); a file's trees hold no reference cycles, so reference
    # counting frees them once the file is done, and a collection after each file is left only for a cycle
    # some rule might make: memory stays one file's worth. The caller's collector is given back as it was
    # (tests and tools call `main` in their own process).
    enabled = gc.isenabled()
    gc.disable()
    gc.freeze()
    try:
        return _main(argv)
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def _main(argv: Sequence[str] | None) -> int:
    args = parser().parse_args(argv)
    try:
        config = read_config(Path.cwd())
    except CodeCheckError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    split = lambda text: [p for p in text.split(",") if p.strip()]  # noqa: E731
    select = split(args.select) if args.select is not None else config.get("select", [])
    ignore = split(args.ignore) if args.ignore is not None else config.get("ignore", [])
    unknown = [p for p in select + ignore if not any(r.startswith(p.strip().upper()) for r in RULES)]
    if unknown:
        print(f"error: no rule matches {', '.join(unknown)}; the rules are {', '.join(sorted(RULES))}", file=sys.stderr)
        return 2
    files, missing = python_files(args.paths, config.get("exclude", []))
    rules = chosen_rules(select, ignore)
    fix_problems: list[str] = []
    if args.fix or args.diff:
        fixed, fix_problems = apply_fixes(files, rules, write=args.fix, after_each=gc.collect)
        print(fix_summary(fixed, args.fix), file=sys.stderr)
        if args.diff:
            sys.stdout.write("".join(r.diff() for r in fixed))
            for problem in [f"{m}: no such file or folder" for m in missing] + fix_problems:
                print(f"error: {problem}", file=sys.stderr)
            return 2 if missing or fix_problems else int(bool(fixed))
    findings, problems = check(files, rules, after_each=gc.collect)
    problems = list(dict.fromkeys(fix_problems + problems))
    report = WRITERS[args.format](findings, len(files))
    if args.output:
        try:
            Path(args.output).write_text(report, encoding="utf-8")
        except OSError as exc:
            print(f"error: --output {args.output}: could not be written ({exc.strerror or type(exc).__name__})",
                  file=sys.stderr)
            return 2
    else:
        sys.stdout.write(report)
    for problem in [f"{m}: no such file or folder" for m in missing] + problems:
        print(f"error: {problem}", file=sys.stderr)
    if missing or problems:
        return 2
    worst = SEVERITIES.index(args.fail_on)
    return 1 if any(SEVERITIES.index(f.severity) <= worst for f in findings) else 0
