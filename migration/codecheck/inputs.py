"""What the check accepts: Python source as UTF-8 text of at most `MAX_SOURCE_BYTES` per file, from a
paste, an upload or a path. Anything else is a one-line `CodeCheckError` saying why."""

from __future__ import annotations

from pathlib import Path

from migration.codecheck.findings import CodeCheckError

MAX_BYTES = 1_000_000
MAX_SOURCE_BYTES = MAX_BYTES  # per file, pasted or uploaded: every entry point refuses more
MAX_FILES = 20  # files in one check from the app (a paste and uploads)
FINDINGS_KEPT = 200  # findings a check from the app returns (the first, and the first of every rule; the rest counted)


def refuse_unreadable(text: object, filename: str) -> str:
    """`text` if it is source `ast` can read within the size limit; a one-line CodeCheckError otherwise."""
    if not isinstance(text, str):
        raise CodeCheckError(f"{filename}: expected Python source as text; got {type(text).__name__}")
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_SOURCE_BYTES:
        raise CodeCheckError(f"{filename}: {size:,} bytes; the limit is {MAX_SOURCE_BYTES:,} bytes per file")
    if "\0" in text:  # ast.parse refuses it (SyntaxError on 3.11.4+, ValueError before): say where
        line = text.count("\n", 0, text.index("\0")) + 1
        raise CodeCheckError(f"{filename}: contains a null byte (line {line}); Python source is text without "
                             "null bytes")
    return text


def check_pasted(text: str) -> str:
    """`text` if pasted code is within `MAX_SOURCE_BYTES`; CodeCheckError otherwise, e.g.
    `pasted code: 1,200,000 bytes; the limit is 1,000,000 bytes per file`."""
    return refuse_unreadable(text, "pasted code")


def read_upload(path: str | Path) -> tuple[str, str]:
    """(file name, text) of an uploaded file: a .py file of at most `MAX_SOURCE_BYTES` in UTF-8 (a BOM is
    dropped). Anything else is a one-line CodeCheckError naming the file and what is allowed."""
    p = Path(path)
    if p.suffix != ".py":
        raise CodeCheckError(f"{p.name}: only .py files are checked; upload Python source files ending in .py")
    try:
        size = p.stat().st_size
        if size > MAX_SOURCE_BYTES:
            raise CodeCheckError(f"{p.name}: {size:,} bytes; the limit is {MAX_SOURCE_BYTES:,} bytes per file")
        data = p.read_bytes()
    except OSError as exc:
        raise CodeCheckError(f"{p.name}: could not be read ({exc.strerror or type(exc).__name__}); upload it again")
    skip = 3 if data.startswith(b"\xef\xbb\xbf") else 0  # a BOM (Windows editors write one) is not source
    try:
        text = data[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = skip + exc.start
        raise CodeCheckError(f"{p.name}: not UTF-8 text (byte 0x{data[at]:02x} at offset {at}); "
                             "upload Python source saved as UTF-8")
    return p.name, refuse_unreadable(text, p.name)


def read_source(path: str | Path) -> tuple[str, str]:
    p = Path(path)
    if p.suffix != ".py":
        raise CodeCheckError(f"{p}: only .py files are checked")
    if p.stat().st_size > MAX_BYTES:
        raise CodeCheckError(f"{p}: {p.stat().st_size:,} bytes; the limit is {MAX_BYTES:,} bytes per file")
    try:  # bytes decoded as they are: --fix writes back the same line endings
        return str(p), p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise CodeCheckError(f"{p}: not UTF-8 text; only Python source is checked")

