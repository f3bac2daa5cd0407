"""Writes the generated parts of the documentation from the code and the benchmarks' records, so that no flag
list, field table, rule table, endpoint list, layer diagram or benchmark figure is copied by hand.

A page marks each generated part as a region,

    <!-- generated:KEY -->
    ...written by GENERATORS[KEY]()...
    <!-- /generated:KEY -->

and this script rewrites every region of every page under docs/ (`--check`: rewrite nothing, list the stale
regions and exit 1). `tests/test_docs.py` fails when a region is stale.

    python docs/generate.py [--check]

Sources: the command lines' parsers (`migration.cli.parser`, `app.py`, `migration.codecheck.lint`), the field
table (`migration.config.fields`), the rule table (`migration.codecheck.rules`), the app's API as a client sees it
(`ui.demo.build_demo(...).get_api_info()`), the import contracts (`.importlinter`) and the benchmarks' records
(`bench/results/*.json`, written by each benchmark's `--json`).
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import functools
import io
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BENCH_RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))

REGION = re.compile(r"(?P<open><!-- generated:(?P<key>[\w:.-]+) -->\n)(?P<body>.*?)(?P<close><!-- /generated:(?P=key) -->)",
                    re.S)
HELP_COLUMNS = "100"  # argparse wraps help to $COLUMNS: fixed, so that the page is the same on every terminal
CHOICES_SHOWN = 8


@contextlib.contextmanager
def clean_environment() -> Iterator[None]:
    """No MIGRATION_* variable (the app's flags default to them) and a fixed help width while a page is made."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith("MIGRATION_")]:
        del os.environ[name]
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def cell(text: Any) -> str:
    """A value as one Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# -- command lines -----------------------------------------------------------------------------------------------

def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:  # argparse keeps its subcommands here; it has no public accessor
        if isinstance(action, argparse._SubParsersAction):
            found += list(action.choices.items())
    return found


def help_block(parser: argparse.ArgumentParser) -> str:
    return "```text\n" + parser.format_help().rstrip() + "\n```\n"


def cli_reference() -> str:
    from migration.cli.parser import build_parser

    with clean_environment():
        parser = build_parser()
        parts = [help_block(parser)]
        for name, sub in subcommands(parser):
            parts.append(f"\n## `{name}`\n\n{help_block(sub)}")
    return "".join(parts)


def app_flags() -> str:
    import app

    with clean_environment():
        return help_block(app.flags_parser())


def linter_flags() -> str:
    from migration.codecheck.lint import parser

    with clean_environment():
        return help_block(parser())


# -- the field table ---------------------------------------------------------------------------------------------

def allowed(field: Any) -> str:
    if field.kind in ("int", "float") and field.limits is not None:
        lo, hi = field.bounds()
        text = f"{lo:g} to {hi:g}"
        return text + (f"; 0: {field.zero}" if field.zero else "")
    choices = field.allowed()
    if choices:
        shown = ", ".join(f"`{c}`" for c in choices[:CHOICES_SHOWN])
        return shown + (f" and {len(choices) - CHOICES_SHOWN} more" if len(choices) > CHOICES_SHOWN else "")
    return {"bool": "true / false"}.get(field.kind, field.kind)


def fields_reference() -> str:
    from migration.config.fields import FIELDS

    rows = [[f"`{f.name}`", f.kind, f"`{f.default!r}`" if f.default not in ("", None) else "", allowed(f),
             f.label if f.section else "(command line only)", ", ".join(f"`{e}`" for e in f.endpoints),
             ", ".join(f"`{c} {f.cli_flag}`" for c in f.commands), f.help]
            for f in FIELDS]
    return markdown_table(["field", "type", "default", "allowed", "form label", "API endpoints", "command line",
                           "help"], rows)


# -- code-check rules --------------------------------------------------------------------------------------------

def rules_reference() -> str:
    from migration.codecheck.rules import rules_markdown

    return rules_markdown()


# -- the app's API -----------------------------------------------------------------------------------------------

@functools.cache
def app_blocks() -> Any:
    """The app's page, built as the server builds it (in a private temporary folder; nothing is served)."""
    tmp = tempfile.mkdtemp(prefix="docs-")
    with clean_environment():
        os.environ.update(MIGRATION_CACHE_DIR=tmp, GRADIO_TEMP_DIR=os.path.join(tmp, "gradio"),
                          GRADIO_ANALYTICS_ENABLED="False")
        from ui.demo import build_demo
        from ui.settings import Settings

        return build_demo(Settings(history_db=os.path.join(tmp, "history.sqlite")))


def app_tabs() -> list[str]:
    """The page's tabs, left to right (the screenshots' manifest names them)."""
    import gradio as gr

    return [block.label for block in app_blocks().blocks.values() if isinstance(block, gr.Tab)]


def api_info() -> dict[str, Any]:
    return app_blocks().get_api_info()


def api_type(parameter: dict[str, Any]) -> str:
    kind = parameter.get("python_type", {}).get("type", "")
    choices = parameter.get("type", {}).get("enum")
    if choices and len(choices) > CHOICES_SHOWN:
        return f"one of {len(choices)} choices (see the field reference)"
    return kind


def api_reference() -> str:
    endpoints = api_info()["named_endpoints"]
    parts = []
    for name, endpoint in sorted(endpoints.items()):
        rows = [[f"`{p['parameter_name']}`", cell(p.get("label", "")), p.get("component", ""), f"`{api_type(p)}`",
                 f"`{p.get('parameter_default')!r}`" if p.get("parameter_has_default") else "required"]
                for p in endpoint["parameters"]]
        returns = ", ".join(f"{r['label']} ({r.get('component', '')})" for r in endpoint["returns"]) or "nothing"
        parts.append(f"### `{name}`\n\n")
        parts.append(markdown_table(["parameter", "label", "component", "type", "default"], rows) if rows
                     else "No parameters.\n")
        parts.append(f"\nReturns: {returns}.\n\n")
    return "".join(parts).rstrip() + "\n"


# -- the layers --------------------------------------------------------------------------------------------------

def layers_reference() -> str:
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    parts = []
    for section in config.sections():
        if not section.startswith("importlinter:contract:"):
            continue
        contract = config[section]
        parts.append(f"**{contract['name']}** (`{contract['type']}`)\n\n")
        if contract["type"] == "layers":
            layers = [line.strip() for line in contract["layers"].splitlines() if line.strip()]
            parts.append("| layer (top first) | packages |\n|---|---|\n")
            for number, layer in enumerate(layers, 1):
                packages = re.split(r"\s*[|:]\s*", layer)
                parts.append(f"| {number} | {', '.join(f'`{p}`' for p in packages)} |\n")
            parts.append("\n")
        else:
            sources = [s.strip() for s in contract["source_modules"].split()]
            forbidden = [s.strip() for s in contract["forbidden_modules"].split()]
            parts.append(f"{', '.join(f'`{s}`' for s in sources)} may not import "
                         f"{', '.join(f'`{f}`' for f in forbidden)}.\n\n")
    return "".join(parts).rstrip() + "\n"


# -- benchmarks --------------------------------------------------------------------------------------------------

def render_record(record: dict[str, Any]) -> str:
    parts = [f"`{record['command']}` · {record['machine']} · {record['date']}\n"]
    for t in record["tables"]:
        if t.get("title"):
            parts.append(f"\n**{t['title']}**\n")
        parts.append("\n" + markdown_table(t["columns"], t["rows"]))
    for note in record.get("notes", ()):
        parts.append(f"\n{note}\n")
    return "".join(parts)


def bench_reference(name: str) -> str:
    path = BENCH_RESULTS / f"{name}.json"
    return render_record(json.loads(path.read_text(encoding="utf-8")))


# -- regions -----------------------------------------------------------------------------------------------------

def prices_reference() -> str:
    """The dated price table the comparison reads (migration/prices.py), each price with its source."""
    from migration.prices import PRICES, PRICES_AS_OF, price_keys

    rows = [[f"`{p.key}`", f"${p.usd_per_hour:,.2f}" if p.usd_per_hour >= 1 else f"${p.usd_per_hour:.4f}", p.unit, p.note, f"[{p.as_of}]({p.source})"]
            for p in PRICES.values()]
    missing = ", ".join(f"`{k}`" for k in price_keys() if k not in PRICES)
    return (markdown_table(["key", "price", "per", "what it is", "source"], rows)
            + f"\nRead {PRICES_AS_OF}. No public price in the table: {missing} (give yours).\n")


GENERATORS: dict[str, Callable[[], str]] = {
    "cli": cli_reference, "app-flags": app_flags, "linter-flags": linter_flags, "fields": fields_reference,
    "rules": rules_reference, "api": api_reference, "layers": layers_reference, "prices": prices_reference,
}


def generator(key: str) -> Callable[[], str]:
    if key.startswith("bench:"):
        return lambda: bench_reference(key.split(":", 1)[1])
    if key not in GENERATORS:
        raise KeyError(f"no generator for the region {key!r}: one of {sorted(GENERATORS)} or bench:NAME")
    return GENERATORS[key]


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def regenerate(text: str, made: dict[str, str]) -> str:
    def fill(m: re.Match[str]) -> str:
        key = m["key"]
        if key not in made:
            made[key] = generator(key)()
        return m["open"] + made[key] + m["close"]

    return REGION.sub(fill, text)


def stale(write: bool = False) -> list[str]:
    """The pages whose generated regions differ from what the code makes now (rewritten when `write`)."""
    made: dict[str, str] = {}
    out = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new = regenerate(text, made)
        if new != text:
            out.append(str(page.relative_to(ROOT)))
            if write:
                page.write_text(new, encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/generate.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; list stale pages and exit 1 if any")
    args = parser.parse_args(argv)
    with contextlib.redirect_stdout(io.StringIO()):  # building the app prints nothing of use here
        found = stale(write=not args.check)
    for page in found:
        print(("stale: " if args.check else "rewrote: ") + page)
    return 1 if (args.check and found) else 0


if __name__ == "__main__":
    sys.exit(main())
