"""List candidates for the code check's removed-API list (`REMOVED` in migration/codecheck/vocabulary.py)
from JAX's CHANGELOG.md.

The changelog is split into version sections (`## jax 0.4.26 (April 3, 2024)`, `## JAX 0.5.0`,
`## jaxlib 0.4.32`, `## jax (0.2.0)`, `## Unreleased`) and each section into bullets; a nested bullet
inherits its parents' words, so the names under "Several deprecated APIs have been removed:" or a
"* Deletions" heading count as removed. In every sentence that says (or sits under one that says)
removed / deleted / no longer available, or deprecated, the names in backticks are collected:
dotted JAX names (`jnp.` and `lax.` read as `jax.numpy.` and `jax.lax.`, `config.x` and `jax_x` flags
as `jax.config.`), bare names qualified by a "From `module`:" or "in `module`", and keyword arguments
("the `a_min` argument to `jax.numpy.clip`", "`in_axis_resources` ... deleted from pjit").
Names in the part of a sentence that names a replacement ("Use `jax.tree.map` instead") are left out,
and so are names that "will be removed" only: those count as deprecations.

Each name is reported once, with the version that first said so (a removal wins over a deprecation),
the sentence, whether REMOVED already covers it (`removed_key`, or PJIT_KEYWORDS for keywords) and
whether the installed JAX still has it: "present", "absent" (the module is there, the name is not),
"module absent" (a module on its path is gone), or "unknown" (a keyword whose function was not found).
The rows that are absent and not in REMOVED come first: those are the candidates to add.
Deprecation-only names are kept (status "deprecated"): one deprecated in the changelog and absent
here was removed later, often by a line that does not name it again.

The output is a list of candidates to review by hand: a changelog line that mentions a name is not
proof that the name was removed, nor that a replacement is a one-to-one swap.

    python bench/removed_api_candidates.py CHANGELOG.md [--since 0.4.0] [--format text|json]

Stdlib only, but for the installed JAX (and Flax), imported to look the names up.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect
import json
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from migration.codecheck.vocabulary import (COMPILE_TRANSFORMS, DEFAULT_ALIASES, JAX_IMPORTERS,  # noqa: E402
                                            PJIT_KEYWORDS, removed_key)

HEADING = re.compile(r"^##\s+(?:(?:jax|jaxlib)\s+\(?v?(\d+(?:\.\d+)+)\)?|(unreleased))\b", re.I)
BULLET = re.compile(r"^(\s*)[*-]\s+(.*)$")
TICKED = re.compile(r"`~?\.?([A-Za-z_][\w.]*)(?:\(\))?`")
REMOVAL = re.compile(r"\b(?:remov(?:ed|al|als)|delet(?:ed|ion|ions)|no longer (?:available|exported|exists?|"
                     r"public|accessible|provided))\b", re.I)
DEPRECATION = re.compile(r"\bdeprecat", re.I)
FUTURE = re.compile(r"\b(?:will|would|to|may|might|shall|could)\s+(?:\w+\s+){0,2}?(?:remov|delet)\w*|"
                    r"\b(?:for|future|upcoming|pending|before(?:\s+its|\s+their)?)\s+remov\w*", re.I)
REPLACEMENT = re.compile(r"\b(?:use(?! of)|instead|replac\w*|in favou?r of|available (?:from|in|as|via|at)|"
                         r"alternatives?|switch to|migrate to|renamed to|moved to|prefer)\b", re.I)
QUALIFIER = re.compile(r"(?:^from|(?:remov|delet|export|APIs?|function|method|name)\w*\s+(?:from|in))\s+"
                       r"(?:\{mod\}\s*)?`~?([A-Za-z_][\w.]*)`", re.I)
FLAX_HEADING = re.compile(r"^v?(\d+(?:\.\d+)+)$|^vNext$")
KEYWORD_NAME = re.compile(r"[a-z][a-z0-9_]*")
KEYWORD_WORDS = re.compile(r"\b(?:argument|parameter|keyword|kwarg)s?\b", re.I)
SENTENCE = re.compile(r"(?<=[.!?])\s+|;\s+")
ALIASES = {**DEFAULT_ALIASES, "core": "jax.core", "config": "jax.config"}
ABSENT = ("absent", "module absent")
MISSING = object()


@dataclasses.dataclass
class Entry:
    """One changelog bullet: its own text and its parents' texts, nearest first."""
    version: str
    text: str
    parents: list[str]


@dataclasses.dataclass
class Candidate:
    name: str
    keyword: str | None  # the keyword argument, when `name` is the function that took it
    status: str  # "removed" or "deprecated"
    version: str
    line: str
    in_removed: bool = False
    installed: str = "unknown"

    @property
    def label(self) -> str:
        return f"{self.name}({self.keyword}=)" if self.keyword else self.name


def heading_version(line: str) -> str | None:
    """'0.4.26' for '## jax 0.4.26 (April 3, 2024)', 'unreleased' for '## Unreleased', else None."""
    match = HEADING.match(line)
    return None if match is None else (match.group(1) or "unreleased")


def version_key(version: str) -> tuple[int, ...]:
    return (10**6,) if version == "unreleased" else tuple(int(part) for part in version.split("."))


def sections(text: str) -> Iterator[tuple[str, list[str]]]:
    """(version, lines) for each version section; lines under other '## ' headings are skipped. Flax's
    changelog underlines its versions instead ('0.6.8' over '-----', 'vNext' for the unreleased one)."""
    version, lines = None, []
    rows = text.splitlines()
    for i, line in enumerate(rows):
        underlined = i + 1 < len(rows) and re.fullmatch(r"-{3,}", rows[i + 1].strip() or "x") is not None
        if line.startswith("## ") or underlined and FLAX_HEADING.match(line.strip()):
            if version:
                yield version, lines
            version, lines = heading_version(line) if line.startswith("## ") else flax_version(line), []
        elif version and not re.fullmatch(r"-{3,}", line.strip() or "x"):
            lines.append(line)
    if version:
        yield version, lines


def flax_version(line: str) -> str:
    match = FLAX_HEADING.match(line.strip())
    return match.group(1) if match.group(1) else "unreleased"


def entries(version: str, lines: list[str]) -> list[Entry]:
    """The bullets of a section, continuation lines joined on, each with its parents' texts."""
    found: list[Entry] = []
    stack: list[tuple[int, Entry]] = []
    for line in lines:
        bullet = BULLET.match(line)
        if bullet:
            indent = len(bullet.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            entry = Entry(version, bullet.group(2).strip(), [e.text for _, e in reversed(stack)])
            found.append(entry)
            stack.append((indent, entry))
        elif line.strip() and stack:
            stack[-1][1].text += " " + line.strip()
    return found


def classify(text: str) -> str | None:
    """'removed', 'deprecated' or None for a piece of changelog text; 'will be removed' is a deprecation."""
    if REMOVAL.search(FUTURE.sub("", text)):
        return "removed"
    return "deprecated" if DEPRECATION.search(text) or FUTURE.search(text) else None


def normalise(name: str, qualifier: str | None) -> str | None:
    """The full JAX name for a backticked one, or None when it is no JAX name."""
    if "." not in name:
        if name.startswith("jax_"):
            return f"jax.config.{name}"
        if not qualifier:
            return None
        name = f"{qualifier}.{name}"
    root, _, rest = name.partition(".")
    name = f"{ALIASES[root]}.{rest}" if root in ALIASES and rest else name
    return name if "." in name and name.split(".")[0] in JAX_IMPORTERS else None


def keyword_owner(sentence: str, qualifier: str | None) -> str | None:
    """The function whose keyword arguments a sentence speaks of ("the `a_min` argument to `jax.numpy.clip`",
    "`in_axis_resources` ... deleted from pjit"): its first dotted name, else pjit & co; None for other sentences."""
    plain = TICKED.sub("", sentence)
    words = re.findall(r"(?<![.\w])\w+", plain) if classify(sentence) and not qualifier else []
    transform = next((word for word in words if word in COMPILE_TRANSFORMS), None)
    if not KEYWORD_WORDS.search(plain) and not transform:
        return None
    dotted = (normalise(span, None) for span in TICKED.findall(sentence))
    return next(filter(None, dotted), transform)


def status_and_line(entry: Entry, sentence: str) -> tuple[str | None, str]:
    """What a sentence says of its names, from itself, else its bullet, else the nearest parent that says."""
    for source in (sentence, entry.text, *entry.parents):
        if status := classify(source):
            return status, sentence if source in (sentence, entry.text) else f"{sentence} [under: {source}]"
    return None, sentence


def entry_candidates(entry: Entry) -> Iterator[Candidate]:
    """The names an entry says were removed or deprecated (replacements left out)."""
    qualifier = next((normalise(q, None) for q in QUALIFIER.findall(entry.text)), None)
    for sentence in SENTENCE.split(entry.text):
        status, line = status_and_line(entry, sentence)
        owner = keyword_owner(sentence, qualifier)
        for span in TICKED.findall(REPLACEMENT.split(sentence)[0]) if status else ():
            if owner and "." not in span and not span.startswith("jax_"):
                if KEYWORD_NAME.fullmatch(span) and span != owner.split(".")[-1]:
                    yield Candidate(owner, span, status, entry.version, line)
            elif (full := normalise(span, qualifier)) and full not in (owner, qualifier):
                yield Candidate(full, None, status, entry.version, line)


def candidates(text: str, since: str | None = None) -> list[Candidate]:
    """One candidate per name: the removal if any said so, else the deprecation, the earliest version first."""
    def rank(c: Candidate) -> tuple:
        return c.status != "removed", version_key(c.version)

    best: dict[str, Candidate] = {}
    for version, lines in sections(text):
        if since and version_key(version) < version_key(since):
            continue
        for entry in entries(version, lines):
            for found in entry_candidates(entry):
                if found.label not in best or rank(found) < rank(best[found.label]):
                    best[found.label] = found
    return list(best.values())


def resolve(name: str) -> object:
    """The object a dotted name names in the installed packages, or MISSING."""
    parts = name.split(".")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
                return obj
            except Exception:  # noqa: BLE001 -- a module that fails to import is as good as gone
                continue
    return MISSING


@functools.cache
def installed(name: str, keyword: str | None = None) -> str:
    """'present', 'absent', 'module absent' or 'unknown' for a name (or a keyword of it) in the installed JAX."""
    if keyword:
        if "." in name and (owner := installed(name)) in ABSENT:
            return owner
        try:
            obj = resolve(name if "." in name else f"jax.{name}")
            return "present" if keyword in inspect.signature(obj).parameters else "absent"
        except Exception:  # noqa: BLE001 -- no function, or no signature to read
            return "unknown"
    if resolve(name.rsplit(".", 1)[0]) is MISSING:
        return "module absent"
    return "absent" if resolve(name) is MISSING else "present"


def group(c: Candidate) -> int:
    """0: absent and not in REMOVED (to add), 1: unknown, not in REMOVED, 2: in REMOVED, 3: present."""
    if c.in_removed:
        return 2 if c.installed != "present" else 3
    return {"absent": 0, "module absent": 0, "unknown": 1}.get(c.installed, 3)


def report(text: str, since: str | None) -> list[Candidate]:
    found = candidates(text, since)
    for c in found:
        c.in_removed = c.keyword in PJIT_KEYWORDS or removed_key(c.name) is not None
        c.installed = installed(c.name, c.keyword)
    return sorted(found, key=lambda c: (group(c), c.status != "removed", version_key(c.version), c.label))


def summary(found: list[Candidate]) -> str:
    def count(test: Callable[[Candidate], bool]) -> int:
        return sum(1 for c in found if test(c))

    return (f"{len(found)} names ({count(lambda c: c.status == 'removed')} removed, "
            f"{count(lambda c: c.status == 'deprecated')} deprecated only): "
            f"{count(lambda c: group(c) == 0)} absent and not in REMOVED (candidates to add), "
            f"{count(lambda c: group(c) == 1)} unknown, {count(lambda c: c.in_removed)} already in REMOVED, "
            f"{count(lambda c: c.installed == 'present')} present in the installed JAX")


def shorten(text: str, width: int = 110) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def print_text(found: list[Candidate]) -> None:
    titles = ["absent, not in REMOVED: candidates to add", "unknown (a keyword of a function not found)",
              "already in REMOVED", "present in the installed JAX"]
    for number, title in enumerate(titles):
        rows = [c for c in found if group(c) == number]
        if rows:
            print(f"== {title} ({len(rows)})")
        for c in rows:
            print(f"{c.version:>10}  {c.status:<10}  {c.installed:<13}  {c.label}\n{'':>12}{shorten(c.line)}")
    print(summary(found))


def strictly_absent(name: str) -> bool:
    """The name's module path imports only up to a missing module (ModuleNotFoundError) or a missing
    attribute (AttributeError); any other failure (a GPU-only module on a CPU machine) is not proof."""
    parts = name.split(".")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            try:
                obj = importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name and not module.startswith(exc.name):
                    return False  # the module is there but needs another package (jax2tf needs TensorFlow)
                continue
            except Exception:  # noqa: BLE001 -- it exists but would not import here
                return False
            for attr in parts[cut:]:
                if not hasattr(obj, attr):
                    return True
                obj = getattr(obj, attr)
            return False
    return True


def replacement(c: Candidate, library: str) -> str:
    """What the changelog names in place of `c` (the first name after "use", "instead", ...), with the
    version; or that it names none."""
    parts = REPLACEMENT.split(c.line.split(" [under: ")[0], maxsplit=1)
    named = [n for span in TICKED.findall(parts[1]) if (n := normalise(span, None) or span)] if len(parts) > 1 else []
    said = "removed" if c.status == "removed" else "deprecated"
    if named and named[0] != c.name:
        return f"{named[0]} ({said} in {library} {c.version}, per its changelog)"
    return f"no one-to-one replacement named ({said} in {library} {c.version}; see its changelog)"


OWN_RULES = {"jax.clear_backends"}  # reported by a rule of its own (REMOVED002)


def generated(jax_text: str, flax_text: str | None) -> dict[str, str]:
    """name -> replacement for each name the changelogs say was removed or deprecated and that is
    strictly absent here; keyword arguments and `jax.Array` methods are left out (the check cannot
    see which function or array they belong to)."""
    out: dict[str, str] = {}
    for text, library in ((jax_text, "JAX"), (flax_text, "Flax")):
        for c in candidates(text or ""):
            if c.keyword or c.name.startswith("jax.Array.") or c.name in OWN_RULES or not strictly_absent(c.name):
                continue
            out[c.name] = replacement(c, library)
    return dict(sorted(out.items()))


def write_module(path: Path, names: dict[str, str], sources: list[Path]) -> None:
    import jax
    try:
        import flax
        flax_version = flax.__version__
    except ImportError:
        flax_version = "not installed"
    rows = "\n".join(f"    {name!r}: {text!r}," for name, text in names.items())
    path.write_text(f'''"""Names JAX's and Flax's changelogs say were removed or deprecated, each absent from JAX {jax.__version__}
and Flax {flax_version}: generated by bench/removed_api_candidates.py from {", ".join(p.name for p in sources)} in
bench/data/changelogs/; do not edit by hand. The hand-kept table in vocabulary.py (REMOVED) wins where both
name a replacement.

    python bench/removed_api_candidates.py bench/data/changelogs/jax_CHANGELOG.md \\
        --flax bench/data/changelogs/flax_CHANGELOG.md --write migration/codecheck/removed_api.py
"""

CHANGELOG_REMOVED = {{
{rows}
}}
''', encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("changelog", type=Path, help="JAX's CHANGELOG.md")
    parser.add_argument("--since", help="only versions from this one on, e.g. 0.4.0")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--flax", type=Path, help="Flax's CHANGELOG.md (with --write)")
    parser.add_argument("--write", type=Path, help="write the generated table (migration/codecheck/removed_api.py)")
    args = parser.parse_args(argv)
    for given in (args.changelog, args.flax):
        if given is not None and not given.is_file():
            parser.error(f"{given}: no such file (a CHANGELOG.md is expected)")
    if args.write and not args.write.parent.is_dir():
        parser.error(f"--write {args.write}: its folder does not exist")
    if args.write:
        flax_text = args.flax.read_text(encoding="utf-8") if args.flax else None
        names = generated(args.changelog.read_text(encoding="utf-8"), flax_text)
        try:
            write_module(args.write, names, [args.changelog] + ([args.flax] if args.flax else []))
        except OSError as error:
            parser.error(f"--write {args.write}: cannot be written ({error.strerror})")
        print(f"{len(names)} names written to {args.write}")
        return 0
    found = report(args.changelog.read_text(encoding="utf-8"), args.since)
    if args.format == "json":
        rows = [{**dataclasses.asdict(c), "label": c.label, "line": shorten(c.line, 200)} for c in found]
        print(json.dumps({"candidates": rows, "summary": summary(found)}, indent=1))
    else:
        print_text(found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
