"""Silencing comments: `# migration: ignore[RULE1, RULE2] reason` silences the named rules on its line
when the reason has at least `MIN_REASON_WORDS` words. A comment without a reason, or naming no known
rule, silences nothing and is itself reported (IGNORE001)."""

from __future__ import annotations

import dataclasses
import io
import re
import tokenize

from migration.codecheck.findings import Finding
from migration.codecheck.rules import MIN_REASON_WORDS, RULES

# Every quantifier is bounded, so a search costs at most a few hundred steps per character of a
# comment, whatever is pasted (an unbounded `[^\]]*` made a long line of repeated openings quadratic).
IGNORE_COMMENT = re.compile(r"#[ \t]{0,16}migration:[ \t]{0,16}ignore\[([^\]\n]{0,256})\]([^#\n]{0,512})")


@dataclasses.dataclass(frozen=True)
class Ignore:
    line: int
    col: int
    rules: frozenset[str]
    reason: str

    @property
    def has_reason(self) -> bool:
        return sum(any(c.isalpha() for c in w) for w in self.reason.split()) >= MIN_REASON_WORDS


def read_ignores(text: str) -> list[Ignore]:
    found = []
    if "migration:" not in text:
        return found  # no comment can match IGNORE_COMMENT: skip tokenizing
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            m = IGNORE_COMMENT.search(tok.string) if tok.type == tokenize.COMMENT else None
            if m:
                rules = frozenset(r.strip() for r in m.group(1).split(",") if r.strip())
                found.append(Ignore(tok.start[0], tok.start[1] + 1, rules, m.group(2).strip()))
    except (tokenize.TokenError, SyntaxError):
        pass  # the text parsed with ast; comments read so far stand
    return found


def apply_ignores(findings: list[Finding], ignores: list[Ignore], filename: str) -> list[Finding]:
    rule = RULES["IGNORE001"]
    silenced: dict[int, frozenset[str]] = {}
    extra = []
    for ig in ignores:
        unknown = sorted(ig.rules - RULES.keys())
        if not ig.has_reason:
            message = f"`# migration: ignore[{', '.join(sorted(ig.rules))}]` has no reason, so it silences nothing"
        elif unknown or not ig.rules:
            message = f"`# migration: ignore[...]` names no known rule ({', '.join(unknown) or 'none given'})"
        else:
            message = None
        if message:
            extra.append(Finding(filename, ig.line, ig.col, rule.id, rule.severity, message, rule.replacement))
        if ig.has_reason:
            silenced[ig.line] = ig.rules
    kept = [f for f in findings if f.rule not in silenced.get(f.line, ())]
    return kept + extra

