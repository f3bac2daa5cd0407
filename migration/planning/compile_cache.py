"""The disk cache of compiled figures, keyed by what produced them.

A planner compiles many candidate steps (3-20 s each for real models on two cores); the figures of each
(peak and state bytes, and for a GPU or TPU target the program's kernels and collectives) are kept in one
JSON file in `compile_cache_dir()`, under a key of everything that shapes the compile: the packages that
compile (`package_versions`), the code that builds the step (`code_fingerprint` over COMPILE_SOURCES),
the user's own model code (`workload_fingerprint`), the target, the program's settings and XLA's flags.
A change to any of them is another key, never stale figures.

Several processes plan at once (the app's planner workers, compile workers, other instances of the app
sharing the folder): each write merges into what is on disk under a file lock, and a key missing in
memory is looked up again on disk when the file changed, so no process drops or misses another's compiles.

Beside those keys, each lowered program's figures are kept under a key of the program itself
(compiled.py, keys starting with PROGRAM_PREFIX), which depends on the packages and on the code that reads
the figures (FIGURE_SOURCES) but not on the code that builds the program: a code change that leaves a
program as it was finds its figures after one lowering.

Below the file, a read-only store of figures may answer ($MIGRATION_COMPILE_STORE: a .json or .json.gz
written by `write_store`), never written to: its entries by request when it was made by this code and
these packages (`store_fingerprint`), its entries by program when it was made by the same reading code and
packages (`figures_fingerprint`). The test suite keeps one in tests/fixtures/compiled/.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import importlib.metadata
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from migration.common import PROJECT_ROOT, compile_cache_dir, read_json, write_json_atomic

try:  # reason: POSIX only; elsewhere writes are not locked (a lost race loses an entry)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

# The code that shapes a compiled step and the figures kept of it: a change to any of it is another key.
COMPILE_SOURCES = ("workloads/*.py", "migration/step/*.py", "migration/config/layouts.py",
                   "migration/config/requests.py", "migration/planning/memory.py", "migration/planning/compiled.py",
                   "migration/planning/hlo_cost.py", "migration/planning/hlo_collectives.py")
# Files those patterns match that never shape a compiled step: the readers of MaxText and Hugging Face
# configs turn a file into a request (the model's dimensions, which are part of every key themselves).
NOT_COMPILED = ("workloads/configs.py", "workloads/config_keys.py", "workloads/hf_config.py",
                "workloads/maxtext_config.py")
# The code that turns a compiled program into the figures kept of it (the keys by program, compiled.py).
FIGURE_SOURCES = ("migration/planning/compiled.py", "migration/planning/hlo_cost.py",
                  "migration/planning/hlo_collectives.py")
PROGRAM_PREFIX = "program:"
# The packages whose versions change a compile: JAX and its compiler, the CUDA plugin, the TPU compiler,
# the model and optimizer libraries.
COMPILE_PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt",
                    "libtpu", "flax", "optax")
CACHE_FILE = "compile_memory.json"
STORE_ENV = "MIGRATION_COMPILE_STORE"
# How figures were made (a cached entry's "where"): those a store keeps, the same on any machine.
PORTABLE = ("compiled-for-target", "compiled-for-tpu", "compiled-serving", "estimate")


@functools.lru_cache(maxsize=4)
def code_fingerprint(root: Path = PROJECT_ROOT) -> str:
    """sha256 over the sources that shape the compiled step (workloads, train step, policies, fp8, layouts,
    how a candidate is compiled and read)."""
    return sources_fingerprint(COMPILE_SOURCES, root, NOT_COMPILED)


@functools.lru_cache(maxsize=16)
def sources_fingerprint(patterns: tuple[str, ...], root: Path = PROJECT_ROOT, excluded: tuple[str, ...] = ()) -> str:
    """sha256 over the project's files that match `patterns` (except those in `excluded`), names and contents."""
    digest = hashlib.sha256()
    for pattern in patterns:
        for path in sorted(root.glob(pattern)):
            if path.relative_to(root).as_posix() in excluded:
                continue
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def package_versions() -> list[tuple[str, str | None]]:
    found = []
    for name in COMPILE_PACKAGES:
        try:
            found.append((name, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            found.append((name, None))
    return found


def workload_fingerprint(workload: Any) -> str:
    """sha256 over the source of the modules that define `workload`'s model (its class's module, and for a
    model brought through an adapter, the modules of the functions and classes the user gave it:
    `Workload.code_files`) and the Python files beside each (a team's model is often split over a
    package): an edited team model compiles anew, whether registered through an entry point or named as
    module:OBJECT. Read each time: a file edited while the server runs must not keep its old figures."""
    sources = workload.code_files() if hasattr(workload, "code_files") else []
    if not sources:
        return "no-source"
    digest = hashlib.sha256()
    skipped = {PROJECT_ROOT / name for name in NOT_COMPILED}  # the config readers beside the built-in models
    for source in dict.fromkeys(sources):
        here = Path(source)
        for path in [here] + sorted(p for p in here.parent.glob("*.py") if p != here and p not in skipped):
            try:
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
            except OSError:
                continue
    return digest.hexdigest()[:16]


def cache_key(*parts: Any) -> str:
    """The key of a compiled program's figures: the packages and code that compile it, then `parts`
    (what the caller compiles: workload, target, settings, flags)."""
    return hashlib.sha256(json.dumps([package_versions(), code_fingerprint(), *parts], default=str).encode()).hexdigest()


def store_fingerprint() -> str:
    """What a store's figures were made by: the packages and the code. A store made by others is not read."""
    return hashlib.sha256(json.dumps([package_versions(), code_fingerprint()]).encode()).hexdigest()[:16]


def figures_fingerprint() -> str:
    """What a store's entries by program were made by: the packages and the code that reads the figures."""
    return hashlib.sha256(json.dumps([package_versions(), sources_fingerprint(FIGURE_SOURCES)]).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class CompileCache:
    """Compiled figures on disk (one JSON file, shared by every process that plans), over the read-only
    store where one is given."""

    def __init__(self, path: Path | None = None, use_store: bool = True):
        self.path = path or compile_cache_dir() / CACHE_FILE
        self.data: dict[str, Any] = {}
        self._mtime: float | None = None
        self._reload()
        given = os.environ.get(STORE_ENV, "").strip() if use_store else ""
        self.store_path = Path(given) if given else None
        self._store: dict[str, Any] | None = None
        self.store_hits = 0

    def _reload(self) -> None:
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            return
        if mtime != self._mtime:
            self._mtime = mtime
            self.data.update(read_json(self.path, {}))

    def get(self, key: str, keep: bool = False) -> Any:
        """The figures under `key`, from the file or the store (with `keep`, one the store answered is also
        put in the file: a store written from this run's caches keeps what the run read of it)."""
        found = self.data.get(key)
        if found is None:
            self._reload()  # another process may have compiled it meanwhile
            found = self.data.get(key)
        if found is None:
            found = self.store().get(key)
            if found is not None:
                self.store_hits += 1
                if keep:
                    self.put(key, found)
        return found

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        with _locked(self.path.with_name(self.path.name + ".lock")):
            on_disk = read_json(self.path, {})
            on_disk.update({key: value})
            if write_json_atomic(self.path, on_disk):
                self.data.update(on_disk)
                with contextlib.suppress(OSError):
                    self._mtime = self.path.stat().st_mtime

    def store(self) -> dict[str, Any]:
        """The store's entries that this code and these packages can use (by request where the store was
        made by this code, by program where by the same reading code); empty where none is given or it
        cannot be read."""
        if self._store is None:
            self._store = {}
            if self.store_path is not None:
                found = read_store(self.store_path)
                if found.get("programs_fingerprint") == figures_fingerprint():
                    self._store.update(found.get("programs", {}))
                if found.get("fingerprint") == store_fingerprint():
                    self._store.update(found.get("entries", {}))
        return self._store


def read_store(path: Path) -> dict[str, Any]:
    """A store's content ({"fingerprint", "entries"}), or {} where it is missing or not a store."""
    try:
        raw = path.read_bytes()
        data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except (OSError, ValueError, EOFError):
        return {}
    return data if isinstance(data, dict) else {}


def write_store(path: Path, caches: Iterable[Path]) -> int:
    """Write a store of this code's figures at `path` (gzipped JSON when it ends in .gz) from the cache
    files `caches`, replacing what it held (entries by program apart, `CompileCache.store`); returns how many
entries it holds, both kinds. Figures compiled for this
    machine's own devices are left out: they are this machine's, not the code's."""
    entries: dict[str, Any] = {}
    for cache in caches:
        found = read_json(cache, {})
        if isinstance(found, dict):
            entries.update({k: v for k, v in found.items() if isinstance(v, dict) and v.get("where") in PORTABLE})
    programs = {k: entries.pop(k) for k in sorted(entries) if k.startswith(PROGRAM_PREFIX)}
    text = json.dumps({"fingerprint": store_fingerprint(), "entries": dict(sorted(entries.items())),
                       "programs_fingerprint": figures_fingerprint(), "programs": programs},
                      separators=(",", ":"))
    path.parent.mkdir(parents=True, exist_ok=True)
    data = gzip.compress(text.encode(), mtime=0) if path.suffix == ".gz" else text.encode()
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return len(entries) + len(programs)
