"""What every tab's handlers share, created once per server: the settings, the job service and the history,
and the exports and checkpoints folders (each user's calls are limited before they reach a handler: the
gateway's lanes, `ui.lanes`). Also the two rules every handler follows: whose request it is, and how a refusal reads."""

from __future__ import annotations

import dataclasses
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import gradio as gr

from migration.cluster.executors import make_executor
from migration.common import cache_dir, ConfigError, first_line, private_dir, remove_older_than
from migration.running.runner import PlanError
from migration.running.worker_env import nvidia_gpus
from migration.service.history import History
from migration.service.job import user_exports
from migration.service.jobs import JobService
from ui.settings import EXPORTS_MARKER, Settings


@dataclasses.dataclass
class AppContext:
    """The state the handlers share. `create` makes the private folders, opens the history, starts the job
    service (ExecutorError when a Ray cluster is named and cannot be reached) and the thread that removes
    old exports."""

    settings: Settings
    history: History
    service: JobService
    export_dir: Path
    checkpoint_root: Path  # one folder per user; never cleaned up by age
    default_target: str  # the Migrate form's target: this machine when it has a GPU

    @classmethod
    def create(cls, settings: Settings) -> AppContext:
        private_dir(os.environ["GRADIO_TEMP_DIR"])
        export_dir = private_dir(settings.export_dir or cache_dir() / "exports")
        remove_older_than(export_dir, settings.export_max_age_s, keep=(EXPORTS_MARKER,))
        checkpoint_root = private_dir(cache_dir() / "checkpoints")
        history = History(settings.history_db,
                          max_bytes=int(settings.history_max_mb * 2**20) if settings.history_max_mb else None)
        service = JobService(history, export_dir, settings.limits, executor=make_executor(settings.ray_address))
        context = cls(settings=settings, history=history, service=service, export_dir=export_dir,
                      checkpoint_root=checkpoint_root, default_target="local" if nvidia_gpus() else "h100-sxm")
        threading.Thread(target=context.remove_old_exports, name="remove-old-exports", daemon=True).start()
        return context

    def remove_old_exports(self) -> None:
        """Every tenth of the age limit (a minute at most), whether or not anyone exports."""
        while True:
            time.sleep(min(60.0, self.settings.export_max_age_s / 10))
            remove_older_than(self.export_dir, self.settings.export_max_age_s, keep=(EXPORTS_MARKER,))

    def export_path(self, name: str, user: str) -> Path:
        """A new export file in `user`'s own folder, named unguessably (`secrets`)."""
        return (user_exports(self.export_dir, user)
                / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_urlsafe(12)}.csv")


def user_of(request: gr.Request | None) -> str:
    return (getattr(request, "username", None) or "") if request is not None else ""


def refusal_text(exc: BaseException) -> str:
    """One line for a person: what was wrong and what is allowed (never a traceback)."""
    if isinstance(exc, ConfigError):
        return f"Invalid input — {exc}"
    if isinstance(exc, PlanError):
        return f"Planning failed ({exc.kind}): {first_line(exc, 400)}"
    return first_line(exc, 400)


def refuse(exc: BaseException) -> gr.Error:
    """The refusal as a queued event's error (the page shows it beside the event's outputs)."""
    return gr.Error(refusal_text(exc), print_exception=False)


def said(exc: BaseException) -> str:
    """A refusal as a line for the page, for an event unqueued from it: its error would reach the page as an
    HTTP 500 without its text, so the handler returns this to a message beside the control instead."""
    return f"⚠️ {refusal_text(exc)}"


def said_beside(exc: BaseException, others: int) -> tuple[Any, ...]:
    """A queued event's refusal as its first output's line (the progress line under the buttons), the
    `others` outputs left as they are: the handler yields this, then raises the error, so that the page
    shows why beside the control as well as in Gradio's notice, and an API client still gets the error."""
    return (said(exc), *[gr.skip()] * others)
