"""The server's settings (from its flags) and the banner that tells people what kind of host this is."""

from __future__ import annotations

import dataclasses

from migration.common import GiB
from migration.running.worker_env import nvidia_gpus
from migration.service.job import Limits

EXPORTS_MARKER = ".tpu-gpu-migration-exports"  # marks a folder as this app's exports (old files get deleted)


@dataclasses.dataclass(frozen=True)
class Settings:
    history_db: str = "runs/history.sqlite"
    export_dir: str = ""  # default: a private folder under the cache directory
    limits: Limits = Limits()
    multi_user: bool = False  # auth configured: every job has an owner
    export_max_age_s: float = 7 * 24 * 3600
    history_max_mb: float | None = None
    ray_address: str = ""  # a Ray cluster for the runs and catalog plans (MIGRATION_RAY_ADDRESS); empty: this machine
    admins: tuple[str, ...] = ()  # users who may see, compare and export everyone's history
    team_history: bool = False  # the operator declared the history visible to every signed-in user


def host_banner(settings: Settings) -> str:
    gpus = nvidia_gpus()
    users = ((f"Signed-in users each see and stop their own jobs. History: {history_visibility(settings)}.")
             if settings.multi_user else
             "**Single-user mode** (no auth configured): everyone who can reach this page shares one identity, "
             "one history and one Stop.")
    if not gpus:
        return ("**This host has no NVIDIA GPU.** Runs execute on JAX's CPU backend and are labelled as CPU "
                "figures; GPU targets are planned by compiling for them without the device. " + users)
    names = ", ".join(f"{g['name']} ({g['total_bytes'] / GiB:.0f} GiB)" for g in gpus)
    return f"GPU host: {names}. One GPU job runs at a time; others wait in the queue and see their position. {users}"


def history_visibility(settings: Settings) -> str:
    """Who sees whose history on this server, in one line (the banner and the start-up line say it)."""
    if not settings.multi_user:
        return "one shared history (single user)"
    if settings.team_history:
        return "team-visible: every signed-in user may list everyone's runs (declared with --team-history)"
    if settings.admins:
        return f"each user sees their own; admins ({', '.join(settings.admins)}) may see everyone's"
    return "each user sees only their own"
