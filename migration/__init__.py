"""The migration backend, one package per job, each over the ones below it (`.importlinter` holds the
order; `lint-imports` checks it):

- `cli`: the command line (`python -m migration`);
- `service`: the shared box's jobs (queue, owners, limits), running a plan's runs, autotune, history,
  accounts;
- `cluster`: where runs execute: this machine or a Ray cluster;
- `running`: worker processes, one measured run, checkpoints, profiles;
- `grading`: the migration checklist and the scaling comparison, graded from evidence;
- `planning`: the planner: memory prediction by compiling, the search, the TPU source, the
  environment and launch scripts, plan files;
- `step`: the train step every run and plan compiles, and its precision and remat policies;
- `results`: the typed results (a run's report, a plan);
- `config`: requests and their validation, the form's field table; `hardware`: the GPU and TPU
  catalog;
- `common`: small shared helpers; `codecheck`: the static check of a user's code (standard library
  only).

Never imports gradio or the UI (`ui/`). This package's top level imports nothing heavy: a worker
process sets JAX's environment before JAX is first imported.
"""

from pathlib import Path as _Path

DISTRIBUTION = "tpu-gpu-migration"


def version() -> str:
    """The product's version: `pyproject.toml`'s in a source checkout (the file beside this package), else the
    installed distribution's. One number, reported by `python -m migration --version`, `python app.py --version`,
    `python -m migration.codecheck --version` and kept in CHANGELOG.md."""
    pyproject = _Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():
        # reason: import-time cost: only the version lookup reads TOML or package metadata, and every
        # linter run imports this package
        import tomllib

        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        if project.get("name") == DISTRIBUTION and "version" in project:
            return str(project["version"])
    from importlib import metadata  # reason: as tomllib above

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"
