"""Small helpers the backend shares, one home each: byte formatting, the first line of an error,
out-of-memory markers, the error a bad config value raises, CSV and atomic JSON writing, the cache
directory and JAX's persistent compilation cache in it, and a process's quick exit. Imports nothing heavy at module level (only
`enable_compile_cache` imports JAX): the config layer and the worker's start-up use it.
"""

from __future__ import annotations

import atexit
import csv
import io
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

GiB = 2**30
PROJECT_ROOT = Path(__file__).resolve().parent.parent

# Substrings by which XLA and JAX say that memory ran out (compile- or run-time), on any backend.
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM when allocating")


def fmt_gib(n: float | None, digits: int = 2, missing: str = "n/a") -> str:
    """Bytes as GiB with a unit, or `missing` when unknown."""
    return missing if n is None else f"{n / GiB:.{digits}f} GiB"


def _number(x: float | None) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fmt_number(x: float | None, digits: int = 3, missing: str = "n/a") -> str:
    """A plain number for people: `digits` significant digits, whole numbers from 10**digits up with
    thousands separators: "0.482", "324", "20,766"; never a raw float's seventeen digits."""
    if not _number(x):
        return missing
    if x == int(x) and abs(x) < 10**15:
        return f"{int(x):,}"
    return f"{x:,.0f}" if abs(x) >= 10**digits else f"{x:.{digits}g}"


def fmt_bytes(n: float | None, missing: str = "n/a") -> str:
    """Bytes in the binary unit that fits them, three significant digits: "512 B", "1.5 KiB", "214 MiB",
    "57 GiB", "1.2 TiB"; never "0.000 GiB"."""
    if not _number(n):
        return missing
    unit, scale = byte_unit(n)
    return f"{fmt_number(n / scale)} {unit}"


def byte_unit(n: float) -> tuple[str, int]:
    """The binary unit bytes like `n` read best in, and its size: a chart's axis in the unit of its largest
    value, as `fmt_bytes` writes each figure."""
    return next(((unit, 1024**power) for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB"))
                 if abs(n) >= 1024**power), ("B", 1))


def fmt_count(x: float | None, unit: str = "", missing: str = "n/a") -> str:
    """A count or rate for people, three significant digits with a decimal suffix and its unit:
    "950 samples/s", "171k tokens/s", "5.28M tokens/s", "1T tokens"."""
    if not _number(x):
        return missing
    text = fmt_number(x)
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            text = f"{fmt_number(x / scale)}{suffix}"
            break
    return f"{text} {unit}" if unit else text


def fmt_percent(fraction: float | None, missing: str = "n/a") -> str:
    """A fraction as a percentage, three significant digits: "9.5%", "0.42%", "100%"."""
    return f"{fmt_number(100 * fraction)}%" if _number(fraction) else missing


def fmt_seconds(s: float | None, missing: str = "n/a") -> str:
    """A short duration in the unit that fits it, three significant digits: "57 ns", "480 µs", "1.15 ms", "2.31 s"."""
    if s is None or not math.isfinite(s):
        return missing
    scale, unit = next(((k, u) for k, u in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")) if abs(s) >= k), (1e-9, "ns"))
    v = s / scale
    return f"{v:.3g} {unit}" if abs(v) < 1000 else f"{v:,.0f} {unit}"


def duration_unit(s: float) -> tuple[str, float]:
    """The unit a long duration reads best in, and its seconds: hours below two days, days below two
    years, then years."""
    hours = s / 3600
    return ("h", 3600.0) if hours < 48 else ("days", 86400.0) if hours < 2 * 8766 else ("years", 8766 * 3600.0)


def fmt_duration(s: float | None, missing: str = "n/a", like: float | None = None) -> str:
    """A long duration (time to train) in hours, days or years: "5.2 h", "38.4 days", "2.1 years"; in the
    unit that suits `like` where given (two figures side by side in one unit)."""
    if s is None or not math.isfinite(s):
        return missing
    unit, scale = duration_unit(like if like is not None and math.isfinite(like) else s)
    v = s / scale
    return f"{v:,.3g} {unit}" if v < 1000 else f"{v:,.0f} {unit}"


def fmt_usd(x: float | None, missing: str = "n/a") -> str:
    """Dollars, to the cent below $100, whole dollars above: "$12.34", "$1,234,567"."""
    if x is None or not math.isfinite(x):
        return missing
    return f"${x:,.2f}" if x < 100 else f"${x:,.0f}"


def fmt_loss(value: object, digits: int = 4) -> str:
    """A loss as the worker reports it: a float, or None / "inf" / "-inf" where it was not finite."""
    if isinstance(value, (int, float)) and math.isfinite(value):
        return f"{value:.{digits}f}"
    return "nan" if value is None else str(value)


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


def is_oom(text: str) -> bool:
    return any(marker in text for marker in OOM_MARKERS)


def fmt_model(overrides: Mapping[str, Any]) -> str:
    """Dimension overrides as one line, "n_layers=4 d_model=256", in a stable order ("" for none)."""
    return " ".join(f"{k}={overrides[k]}" for k in sorted(overrides))


def model_name(workload: str, preset: str, overrides: Mapping[str, Any] | None) -> str:
    """How a model is named to the user: "llama/8b" for a preset as published; a model given by its
    dimensions is not that preset, so it is "llama custom (d_model=8192 n_layers=80; from 8b)". How the
    code runs it (the attention kernel, the layer loop) does not make a model custom."""
    overrides = dict(overrides or {})
    kernel = {k: overrides.pop(k) for k in ("attention", "layer_loop") if k in overrides}
    if not overrides:
        return f"{workload}/{preset}" + (f" ({fmt_model(kernel)})" if kernel else "")
    return f"{workload} custom ({fmt_model({**overrides, **kernel})}; from {preset})"


def csv_cell(value: Any) -> Any:
    """A text cell starting with = + - @ would be evaluated by a spreadsheet: neutralise it."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def write_csv(rows: Iterable[Mapping[str, Any]], fields: list[str] | None = None,
              path: str | Path | None = None) -> str:
    """A header row and one row per mapping (columns: `fields`, else every key in order of first
    appearance), spreadsheet-safe cells; written to `path` when given. Returns the text."""
    rows = list(rows)
    if fields is None:
        fields = []
        for row in rows:
            fields.extend(k for k in row if k not in fields)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: csv_cell(row.get(k)) for k in fields})
    if path is not None:
        Path(path).write_text(buf.getvalue())
    return buf.getvalue()


def json_safe(value: Any) -> Any:
    """Non-finite floats as JSON can carry them: NaN -> null, infinities -> \"inf\" / \"-inf\"."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json_atomic(path: Path, data: Any) -> bool:
    """Write JSON through a temporary file and a rename, so a reader never sees half a file.
    Returns False (and writes nothing) where the folder is not writable."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
        return True
    except OSError:
        return False


def read_upload(path: Any, field: str, limit: int, what: str) -> bytes:
    """At most `limit` + 1 bytes of an uploaded file (Gradio's copy of it, a path string), or
    ConfigError(field, ...) saying it must be `what` or could not be read."""
    if not isinstance(path, str):
        raise ConfigError(field, f"must be {what}")
    try:
        with open(path, "rb") as f:
            return f.read(limit + 1)
    except OSError as exc:
        raise ConfigError(field, f"could not be read ({exc.strerror or type(exc).__name__}); upload it again") from None


def read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def cache_dir() -> Path:
    """The service's own files ($MIGRATION_CACHE_DIR): Gradio's uploads, exports, checkpoints, and by
    default the compiled figures (`compile_cache_dir`); a folder private to the service user (created on
    first use)."""
    return private_dir(os.environ.get("MIGRATION_CACHE_DIR", Path.home() / ".cache" / "tpu-gpu-migration"))


def compile_cache_dir() -> Path:
    """Where compiled figures are kept ($MIGRATION_COMPILE_CACHE_DIR, else `cache_dir()`): the planner's
    figures of each compiled candidate, the CPU's measured peak and JAX's persistent compilation cache.
    Every entry is keyed by what produced it (code, packages, flags, target, program) and holds nothing of
    a user's, so several instances of the app, or a cluster's nodes on a shared disk, may share one
    folder and each other's compiles. Private to the service user."""
    given = os.environ.get("MIGRATION_COMPILE_CACHE_DIR", "").strip()
    return private_dir(given) if given else cache_dir()


# JAX's persistent compilation cache keeps every compile that took at least this long. Loading an
# entry back takes up to about a tenth of a second, so a shorter compile gains little and only adds files.
COMPILE_CACHE_MIN_COMPILE_S = 0.2


def enable_compile_cache(folder: str | Path | None = None) -> Path | None:
    """Point JAX's persistent compilation cache at `folder` (default: `compile_cache_dir() / "xla"`, private
    to the service user), keeping compiles of COMPILE_CACHE_MIN_COMPILE_S and longer whatever their
    size, on every backend that can reload an executable (CPU and GPU; a deviceless compile for a
    described GPU is written but cannot be read back). Imports JAX; call it before the process's
    first compile. Returns the folder, or None where JAX_ENABLE_COMPILATION_CACHE switched the cache
    off. Raises OSError where the folder cannot be made."""
    import jax  # reason: import-time cost: the config layer and the worker's start-up import this module

    if not jax.config.jax_enable_compilation_cache:
        return None
    path = private_dir(compile_cache_dir() / "xla" if folder is None else folder)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", COMPILE_CACHE_MIN_COMPILE_S)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor, and JAX may not set one
    return path


def private_dir(path: str | Path) -> Path:
    """`path` as a folder only its owner can read (created if missing; tightened if it exists)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def remove_older_than(folder: str | Path, age_s: float, keep: tuple[str, ...] = ()) -> int:
    """Delete files (and emptied folders) under `folder` last modified more than `age_s` ago, but
    those named in `keep`; returns how many files went. Files another process removes meanwhile are
    skipped."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    cutoff = time.time() - age_s
    removed = 0
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        try:
            if path.is_file() and path.name not in keep and path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
            elif path.is_dir() and not any(path.iterdir()) and path.stat().st_mtime < cutoff:
                path.rmdir()
        except OSError:
            continue
    return removed


SHOWN_MAX_CHARS = 60  # characters of a received value quoted back in a message


def one_of(allowed: Iterable[str]) -> str:
    """The allowed values of a choice for a refusal, "a, b, c"; a long list of names that share prefixes
    ("tpu-v4-8", "tpu-v4-16", ...) grouped by the part before their last "-": "tpu-v4-{8,16}, ...", so that
    the message stays a readable line and still names every value."""
    allowed = list(allowed)
    if len(allowed) <= 24:
        return ", ".join(allowed)
    groups: dict[str, list[str]] = {}
    for value in allowed:
        prefix, _, rest = value.rpartition("-")
        groups.setdefault(prefix if prefix else value, []).append(rest if prefix else "")
    return ", ".join(prefix if values == [""] else f"{prefix}-{{{','.join(values)}}}" if len(values) > 1
                     else f"{prefix}-{values[0]}" for prefix, values in groups.items())


class ConfigError(ValueError):
    """A config field (a form, API, command-line or plan-file value) is invalid. `str()` is one line
    naming the field and what is allowed. Here, below the config layer, so that the catalogs it
    validates against (prices, hardware) raise it without importing the config layer."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


def shown(value: Any) -> str:
    """`repr(value)`, cut to a readable length (the message stays one line)."""
    try:
        text = repr(value)
    except ValueError:  # an int of over 4,300 digits
        return f"an int of {value.bit_length():,} bits" if isinstance(value, int) else type(value).__name__
    if len(text) > SHOWN_MAX_CHARS:
        extra = f", {len(value):,} characters" if isinstance(value, str) else ""
        text = f"{text[:SHOWN_MAX_CHARS]}... ({type(value).__name__}{extra})"
    return text


def mix_text(classes: list[Any]) -> str:
    """A plan's request mix in words: "prompt 1,024, generation 256 tokens", or its classes."""
    if len(classes) == 1:
        return f"prompt {classes[0][1]:,}, generation {classes[0][2]:,} tokens"
    return "mix " + ", ".join(f"{share:.0%} {prompt:,}:{gen:,}" for share, prompt, gen in classes)


def experts_text(plan: dict[str, Any]) -> str:
    """A serving plan's mixture-of-experts summary in words, or "" for a dense model."""
    moe = plan.get("mixture_of_experts")
    if not moe:
        return ""
    rows = plan.get("rows") or []
    touched = ", ".join(f"{r['experts_touched']:.1f} at {r['batch']:,}" for r in rows if r.get("experts_touched"))
    return (f"Mixture of experts: {moe['param_count'] / 1e9:.1f}B parameters, {moe['active_param_count'] / 1e9:.1f}B "
            f"active a token; {moe['experts']} routed experts (top {moe['top_k']}) in {moe['moe_layers']} layers, "
            f"{moe['layout']} ({moe['experts_per_gpu']} a GPU, {moe['routed_bytes_per_gpu_held'] / 1e9:.1f} GB of "
            f"them per GPU); attention {moe['attention']}. A decode step reads the experts its tokens touch "
            f"(expected, even routing: {touched} running sequences); the routed experts are priced {moe['priced']}.")


def leave(code: int) -> None:
    """End the process with `code` as the interpreter would, less its last part: a worker's and the command
    line's last call. First what a normal exit does, in its order: the threads' exit hooks and joins, the
    `atexit` handlers (JAX's clean-up and distributed shutdown, the runner's stop of live workers, the kernel
    caches' removal), the streams flushed. Left out: the teardown of every loaded module, one object at a
    time, which with JAX and Flax loaded cost a run or plan worker 0.3 to 0.6 s of CPU and of wall time
    (bench/worker_exit.py), after its result was sent and before the runner, which reaps it first, could
    report the outcome and free the queue's slot."""
    threading._shutdown()  # reason: the interpreter's own first step at exit; no public name does it
    atexit._run_exitfuncs()  # reason: as above
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
