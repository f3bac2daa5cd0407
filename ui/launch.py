"""Serving the page: the job service stopped cleanly on SIGTERM and SIGINT, the start-up line, the web
policy and its middleware, Gradio's queue and launch."""

from __future__ import annotations

import dataclasses
import gc
import os
import secrets
import signal
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import gradio as gr
from starlette.middleware import Middleware

from migration.common import cache_dir, private_dir
from migration.running.runner import ExecutorError
from migration.service.accounts import Authenticator
from migration.service.job import Limits
from migration.service.jobs import JobService
from ui.demo import build_demo
from ui.guard import LoginPageWithoutApi, WebGuard, WebPolicy, allowed_hosts
from ui.lanes import lane_limits
from ui.settings import EXPORTS_MARKER, Settings, history_visibility
from ui.tables import PAGE_CSS


LIGHT_WORKERS = 32  # Gradio queue workers beyond the jobs' and tasks': light calls from API clients


@dataclasses.dataclass(frozen=True)
class Address:
    """Where the server listens and how people reach it (--host, --port, --root-path, --public-url and
    --allowed-hosts)."""

    host: str
    port: int
    root_path: str = ""
    public: urllib.parse.SplitResult | None = None
    allowed_hosts: str = ""  # comma-separated extra host names


def serve(settings: Settings, address: Address, users: Authenticator | None) -> None:
    """Build the page, launch it behind the web policy, and serve until a signal stops the server."""
    try:
        demo = build_demo(settings)
    except ExecutorError as exc:
        raise SystemExit(f"error: {exc}")
    service: JobService = demo.service  # type: ignore[attr-defined]
    stop_on_signals(service)
    token = "" if users is not None else (os.environ.get("MIGRATION_TOKEN") or secrets.token_urlsafe(24))
    export_dir = private_dir(settings.export_dir or cache_dir() / "exports")
    (export_dir / EXPORTS_MARKER).write_text("exports of the TPU -> GPU migration explorer; old files are deleted\n")
    public = address.public
    policy = WebPolicy(hosts=allowed_hosts(address.host, public, address.allowed_hosts),
                       public_origins=frozenset({f"{public.scheme}://{public.netloc}"} if public else ()),
                       token=token, export_dir=export_dir, auth=users is not None,
                       lanes=lane_limits(settings.limits))
    announce(settings, address, users, token, export_dir, service)
    demo.queue(max_size=max(64, 4 * settings.limits.queue_size), default_concurrency_limit=4)
    middleware = [Middleware(WebGuard, policy=policy)] + ([Middleware(LoginPageWithoutApi)] if users else [])
    launch(demo, address, users, export_dir, middleware, queue_workers(settings.limits))


def stop_on_signals(service: JobService) -> None:
    """SIGTERM and SIGINT mark the unfinished jobs interrupted, stop their workers and end the process."""
    def stop(signum: int, _frame: Any) -> None:
        interrupted = service.shutdown()
        print(f"stopped by {signal.Signals(signum).name}: {len(interrupted)} job(s) marked interrupted", flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def announce(settings: Settings, address: Address, users: Authenticator | None, token: str, export_dir: Path,
             service: JobService) -> None:
    """The start-up line: where it serves (the URL with its token when there is no auth), who signs in,
    where the history and exports are; a warning when it serves beyond loopback without auth."""
    host = address.host
    where = ("loopback only" if host in ("127.0.0.1", "localhost", "::1") else
             "ALL interfaces" if host in ("0.0.0.0", "::") else f"interface {host}")
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown_host}:{address.port}{address.root_path or '/'}" + (f"?token={token}" if token else "")
    print(f"serving on {where}{f' ({host})' if shown_host != host else ''}: {url} — "
          + (f"auth on ({len(users)} user(s)); history: {history_visibility(settings)}" if users else
             "no auth: single-user mode, open the URL with its token")
          + f"; history {settings.history_db}; exports {export_dir}"
          + (f"; {service.executor.describe()}" if service.executor.remote else ""), flush=True)
    if users is None and where != "loopback only":
        print("warning: serving beyond loopback without auth: anyone with the URL's token can run jobs",
              file=sys.stderr, flush=True)


def queue_workers(limits: Limits) -> int:
    """Gradio's queue workers: one for every job and task the service admits (each streams its progress
    from a worker for as long as it waits or runs) and room for the light calls past them, so that a full
    job queue never leaves a light call or a Stop without a worker."""
    return limits.queue_size + limits.task_queue + LIGHT_WORKERS


def launch(demo: gr.Blocks, address: Address, users: Authenticator | None, export_dir: Path,
           middleware: list[Middleware], workers: int) -> None:
    # Exports are served from their own folder, not copied into Gradio's cache (where the web guard could
    # not tell whose a copy is): the guard serves a file of that folder to the user whose subfolder holds it.
    gr.set_static_paths([str(export_dir)])
    demo.launch(server_name=address.host, server_port=address.port, root_path=address.root_path or None,
                auth=users.check if users else None,
                enable_monitoring=False, ssr_mode=False, show_error=True, share=False, run_history=False,
                max_threads=workers, allowed_paths=[str(export_dir)], max_file_size="5mb", quiet=True, css=PAGE_CSS,
                app_kwargs={"middleware": middleware}, prevent_thread_lock=True)
    # Everything built so far (Gradio, pandas, the page's components) lives as long as the server:
    # out of the collector's sight, so that a full collection under load walks only what came after
    # (it walked all of it in 0.7 s, every page and call waiting, in the load benchmark).
    gc.freeze()
    demo.block_thread()
