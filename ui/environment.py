"""The Environment tab: what a worker process sees (JAX backend and devices, versions, its JAX/XLA
environment, each NVIDIA GPU's memory), probed in a worker, never in the server."""

from __future__ import annotations

import dataclasses

import gradio as gr

from migration.common import first_line, fmt_bytes
from migration.service.job import LimitError
from ui.context import AppContext, refuse, user_of
from ui.streaming import finished


@dataclasses.dataclass
class EnvironmentTab:
    button: gr.Button
    markdown: gr.Markdown
    details: gr.JSON


def environment_tab() -> EnvironmentTab:
    with gr.Tab("Environment"):
        return EnvironmentTab(button=gr.Button("Probe the environment (in a worker)"),
                              markdown=gr.Markdown(label="Environment", show_label=False),
                              details=gr.JSON(label="Details"))


def wire_environment(tab: EnvironmentTab, context: AppContext) -> None:
    """Probe: the findings as markdown, and in full as JSON."""
    tab.button.click(EnvironmentHandlers(context).do_environment, None, [tab.markdown, tab.details],
                     api_name="environment", concurrency_limit=None)


class EnvironmentHandlers:
    """/environment: the probe runs in a worker; the handler waits for it."""

    def __init__(self, context: AppContext):
        self.context = context

    async def do_environment(self, request: gr.Request):
        service = self.context.service
        try:
            job = await finished(service, service.submit_probe(user_of(request)))
        except LimitError as exc:
            raise refuse(exc)
        if job.result is None:
            raise gr.Error(f"The environment probe failed: {first_line(job.error or 'no result', 300)}",
                           print_exception=False)
        info = job.result
        warnings = list(info["warnings"]) + [
            "The server process never initialises JAX's GPU backend: JAX would preallocate 75% of each GPU "
            "for it. Plans and runs happen in worker processes with XLA_PYTHON_CLIENT_PREALLOCATE=false."]
        lines = [f"**Backend:** {info['backend']} ({info['device_count']} device(s): "
                 + ", ".join(d["kind"] for d in info["devices"]) + ")",
                 "**Versions:** " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()),
                 "**JAX/XLA environment of a worker:** " + ", ".join(f"`{k}={v}`" for k, v in info["env"].items())]
        for g in info["nvidia_gpus"]:
            lines.append(f"**GPU {g['index']}** {g['name']}: {fmt_bytes(g['used_bytes'])} used of {fmt_bytes(g['total_bytes'])}, "
                         f"{fmt_bytes(g['used_by_other_processes_bytes'])} by other processes")
        lines += [f"⚠️ {w}" for w in warnings]
        return "\n\n".join(lines), info
