"""Gradio app: plan, run, watch, compare and export TPU-to-GPU migrations on a shared GPU box.

This file parses the flags (each also read from a MIGRATION_* variable), checks them into `ui.settings.Settings`
and launches the page (`ui.launch`). The page itself is the `ui` package: a thin shell over the backend
(`migration/`). Form values go through `migration.config.forms` (every field checked, refusals name the
field), jobs go to `migration.service.jobs.JobService` (queue, owners, per-user limits, records that survive
a restart), and typed results are formatted in `ui.frames`. The server process never initialises a JAX backend
(it would claim 75% of a shared GPU); every plan and run happens in a worker process.

    python app.py --host 127.0.0.1 --port 7860 [--root-path /migrate] [--auth-file users.txt]
                  [--history-db runs/history.sqlite] [--jobs-per-user 4] [--max-steps 10000] ...
"""

from __future__ import annotations

import argparse
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any

from migration import version
from migration.config.limits import LIMITS
from migration.running.worker import WORKER_CPUS_VARIABLE
from migration.service.accounts import Authenticator
from migration.service.job import Limits
from ui.guard import read_auth
from ui.settings import EXPORTS_MARKER, Settings


def main() -> None:
    args = parse_flags()
    os.umask(0o077)  # every file the server and its workers create (history, runs, exports, checkpoints) is private
    for existing in Path(args.history_db).parent.glob(Path(args.history_db).name + "*"):  # a history an earlier
        os.chmod(existing, 0o600)  # version left readable (with its -wal and -shm) is tightened too
    users = read_auth(args.auth_file, os.environ.get("MIGRATION_AUTH"))
    settings, public = checked_settings(args, users)
    # reason: the page's module imports Gradio (about 4 s on two cores): flags are read, and bad ones
    # refused, before it
    from ui.launch import Address, serve

    serve(settings, Address(host=args.host, port=args.port, root_path=args.root_path, public=public,
                            allowed_hosts=args.allowed_hosts), users)


def parse_flags(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; a flag left out takes its MIGRATION_* variable, else its default."""
    return flags_parser().parse_args(argv)


def flags_parser() -> argparse.ArgumentParser:
    """The app's flags, each defaulting to its MIGRATION_* variable when set (the reference page in docs/ is
    generated from this parser)."""
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python app.py", description="TPU -> GPU migration explorer (Gradio app)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    parser.add_argument("--host", default=env("MIGRATION_HOST", "127.0.0.1"),
                        help="address to listen on (default loopback); 0.0.0.0 serves every interface: use with auth")
    parser.add_argument("--port", type=bounded(int, 1, 65535), default=env("MIGRATION_PORT", "7860"))
    parser.add_argument("--root-path", default=env("MIGRATION_ROOT_PATH", ""),
                        help="path prefix behind a reverse proxy")
    parser.add_argument("--auth-file", default=env("MIGRATION_AUTH_FILE"), help="file of user:password lines")
    parser.add_argument("--history-db", default=env("MIGRATION_HISTORY_DB", "runs/history.sqlite"))
    parser.add_argument("--history-max-mb", type=bounded(float, 0, 10**7), default=env("MIGRATION_HISTORY_MAX_MB", "0"),
                        help="cap on the history's size (0: none); past it new records are refused, old ones kept")
    parser.add_argument("--export-dir", default=env("MIGRATION_EXPORT_DIR", ""),
                        help="where CSV exports and traces are written (default: private folder in the cache)")
    parser.add_argument("--export-max-age-hours", type=bounded(float, 1e-4, 10**6),
                        default=env("MIGRATION_EXPORT_MAX_AGE_HOURS", "168"))
    limit_flags(parser)
    parser.add_argument("--worker-cpus", default=env(WORKER_CPUS_VARIABLE, ""),
                        help="CPUs the workers run on (e.g. 2-15), keeping the others for the server; default: all")
    parser.add_argument("--admins", default=env("MIGRATION_ADMINS", ""),
                        help="comma-separated users who may see, compare and export everyone's history")
    parser.add_argument("--team-history", action="store_true", default=env("MIGRATION_TEAM_HISTORY", "") == "1",
                        help="declare the history visible to every signed-in user (default: each sees their own)")
    parser.add_argument("--public-url", default=env("MIGRATION_PUBLIC_URL", ""),
                        help="the URL users open behind a reverse proxy (https://host/path): its origin may call the "
                             "API and its host is answered")
    parser.add_argument("--allowed-hosts", default=env("MIGRATION_ALLOWED_HOSTS", ""),
                        help="comma-separated extra host names this server answers as (default: the address it "
                             "listens on, this machine's names, and --public-url's host)")
    parser.add_argument("--ray-address", default=env("MIGRATION_RAY_ADDRESS", ""),
                        help="run the runs, and plans for catalog GPUs, on this Ray cluster (host:port, "
                             "ray://host:port or auto); default: here")
    return parser


def limit_flags(parser: argparse.ArgumentParser) -> None:
    """The per-user and per-job limits (`migration.service.jobs.Limits`)."""
    env = os.environ.get
    d = Limits()
    parser.add_argument("--jobs-per-user", type=bounded(int, 1, 10_000),
                        default=env("MIGRATION_JOBS_PER_USER", str(d.jobs_per_user)))
    parser.add_argument("--max-steps", type=bounded(int, 1, int(LIMITS["steps"][1])),
                        default=env("MIGRATION_MAX_STEPS", str(d.max_steps)))
    parser.add_argument("--max-run-seconds", type=bounded(float, 10, LIMITS["timeout_s"][1]),
                        default=env("MIGRATION_MAX_RUN_SECONDS", str(d.max_run_s)))
    parser.add_argument("--silence-seconds", type=bounded(float, *LIMITS["silence_timeout_s"]),
                        default=env("MIGRATION_SILENCE_SECONDS", str(d.silence_s)),
                        help="a worker silent this long (no heartbeat) is killed and reported as timeout")
    parser.add_argument("--queue-size", type=bounded(int, 1, 100_000),
                        default=env("MIGRATION_QUEUE_SIZE", str(d.queue_size)),
                        help="jobs waiting or running, all users together")
    parser.add_argument("--job-budget-seconds", type=bounded(float, 60, 7 * 24 * 3600),
                        default=env("MIGRATION_JOB_BUDGET_SECONDS", str(d.job_budget_s)),
                        help="wall-clock of one job's workers together (a run job may start several)")
    parser.add_argument("--user-day-seconds", type=bounded(float, 60, 10**7),
                        default=env("MIGRATION_USER_DAY_SECONDS", str(d.user_day_s)),
                        help="worker time of one user's jobs in any 24 hours")
    parser.add_argument("--history-rows-per-user", type=bounded(int, 10, 10**8),
                        default=env("MIGRATION_HISTORY_ROWS_PER_USER", str(d.history_rows_per_user)))
    parser.add_argument("--history-mb-per-user", type=bounded(float, 1, 10**7),
                        default=env("MIGRATION_HISTORY_MB_PER_USER", str(d.history_mb_per_user)))


def checked_settings(args: argparse.Namespace,
                     users: Authenticator | None) -> tuple[Settings, urllib.parse.SplitResult | None]:
    """The settings and the split --public-url, once the flags agree with each other and with the users;
    SystemExit naming the flag otherwise. Sets the workers' CPUs (--worker-cpus) in the environment."""
    admins = tuple(sorted({a.strip() for a in args.admins.split(",") if a.strip()}))
    if (admins or args.team_history) and users is None:
        raise SystemExit("error: --admins and --team-history need users (--auth-file or MIGRATION_AUTH)")
    unknown = [a for a in admins if users is not None and a not in users.users]
    if unknown:
        raise SystemExit(f"error: --admins names {', '.join(unknown)}, who are not users of this server")
    public = urllib.parse.urlsplit(args.public_url) if args.public_url else None
    if public is not None and (public.scheme not in ("http", "https") or not public.hostname):
        raise SystemExit(f"error: --public-url must be http(s)://host[:port][/path]; got {args.public_url!r}")
    existing_export_dir(args.export_dir)
    limits = Limits(jobs_per_user=args.jobs_per_user, max_steps=args.max_steps, max_run_s=args.max_run_seconds,
                    silence_s=args.silence_seconds, queue_size=args.queue_size, job_budget_s=args.job_budget_seconds,
                    user_day_s=args.user_day_seconds, history_rows_per_user=args.history_rows_per_user,
                    history_mb_per_user=args.history_mb_per_user)
    if args.worker_cpus:
        if not re.fullmatch(r"[0-9]{1,4}(-[0-9]{1,4})?(,[0-9]{1,4}(-[0-9]{1,4})?){0,63}", args.worker_cpus):
            raise SystemExit(f"error: --worker-cpus must be CPU numbers and ranges like 2-15 or 1,3; "
                             f"got {args.worker_cpus!r}")
        os.environ[WORKER_CPUS_VARIABLE] = args.worker_cpus  # read by each worker at its start
    settings = Settings(history_db=args.history_db, export_dir=args.export_dir, limits=limits,
                        multi_user=users is not None, export_max_age_s=args.export_max_age_hours * 3600,
                        history_max_mb=args.history_max_mb or None, ray_address=args.ray_address, admins=admins,
                        team_history=bool(args.team_history))
    return settings, public


def existing_export_dir(path: str) -> str:
    """An --export-dir the app may own: new, empty, or already marked as this app's (the folder's old
    files are deleted by age, so a folder of someone's own files is refused)."""
    if not path:
        return path
    folder = Path(path)
    if folder.is_dir() and any(folder.iterdir()) and not (folder / EXPORTS_MARKER).is_file():
        raise SystemExit(f"error: --export-dir {path}: the folder holds files and is not this app's exports folder "
                         f"(no {EXPORTS_MARKER}); its old files would be deleted, so name an empty or new folder")
    return path


def bounded(kind: type, lo: float, hi: float) -> Any:
    """An argparse type: a `kind` number from lo to hi (flags and their MIGRATION_* variables alike)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'a whole number' if kind is int else 'a number'} "
                                             f"from {lo:g} to {hi:g}; got {text!r}")
        if not lo <= value <= hi:  # NaN fails this too
            raise argparse.ArgumentTypeError(f"must be from {lo:g} to {hi:g}; got {text!r}")
        return value
    return parse


if __name__ == "__main__":
    main()
