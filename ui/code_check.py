"""The Code check tab: paste a script or upload .py files, and say what the code is (the training job, or a
server that serves the model); a worker reads them with `ast` (nothing is ever run) and the findings come back
as a table. The result goes to the checklist of its kind: a training script's to the Migrate tab's, a serving
script's to the Serve tab's. Neither checklist grades from the other kind of code."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import gradio as gr

from migration.common import shown as quoted
from migration.codecheck import MAX_FILES, CodeCheck, CodeCheckError, check_pasted, read_upload
from migration.service.job import LimitError
from ui.context import AppContext, user_of
from ui.frames import findings_frame
from ui.streaming import finished


CODE_KINDS = ("training", "serving")  # what the checked code is: the checklist that grades from it


@dataclasses.dataclass
class CodeCheckTab:
    kind: gr.Radio
    text: gr.Code
    files: gr.File
    button: gr.Button
    summary: gr.Markdown
    table: gr.Dataframe


def code_check_tab() -> CodeCheckTab:
    with gr.Tab("Code check"):
        gr.Markdown("Reads Python source with `ast`; nothing is ever run. Up to 1 MB per file, UTF-8.")
        kind = gr.Radio(list(CODE_KINDS), value="training", label="What this code is",
                        info="training: graded by the Migrate tab's checklist; serving: by the Serve tab's")
        return CodeCheckTab(kind=kind, text=gr.Code(language="python", label="Paste a training or serving script"),
                            files=gr.File(label="…or upload .py files", file_count="multiple", file_types=[".py"]),
                            button=gr.Button("Check", variant="primary", elem_id="check-button"),
                            summary=gr.Markdown(label="Code check summary", show_label=False),
                            table=gr.Dataframe(label="Findings", wrap=True, visible=False, max_height=100_000,
                                               elem_id="findings-table",
                                               column_widths=["10%", "5%", "5%", "9%", "8%", "36%", "27%"]))


def wire_code_check(tab: CodeCheckTab, context: AppContext, code_state: gr.State, serving_code_state: gr.State) -> None:
    """Check: the summary, the findings table, and the result in the state of its kind's checklist (the Migrate
    tab's for training code, the Serve tab's for serving code)."""
    tab.button.click(CodeCheckHandlers(context).do_code_check, [tab.text, tab.files, tab.kind],
                     [tab.summary, tab.table, code_state, serving_code_state], api_name="code_check",
                     concurrency_limit=None)


class CodeCheckHandlers:
    """/code_check: the check runs in a worker; the handler waits for it (a client that goes away stops it)."""

    def __init__(self, context: AppContext):
        self.context = context

    # Both inputs may be left out (a None default is how the API learns that): one of them is enough.
    async def do_code_check(self, text=None, files=None, kind="training", request: gr.Request | None = None):
        service = self.context.service
        try:
            if kind not in CODE_KINDS:
                raise CodeCheckError(f"kind must be one of {', '.join(CODE_KINDS)} (what the code is); got {quoted(kind)}")
            sources = await asyncio.to_thread(code_sources, text, files)  # reads up to 20 files
            job = await finished(service, service.submit_code_check(user_of(request), sources))
        except (CodeCheckError, LimitError) as exc:
            raise gr.Error(str(exc), print_exception=False)
        if job.result is None:
            raise gr.Error(job.error or "the code check stopped without a result", print_exception=False)
        result: CodeCheck = job.result
        findings = list(result.findings)
        shown = findings  # at most FINDINGS_KEPT (and the first of every rule): the worker caps them
        errors = sum(f.severity == "error" for f in findings) + sum(n for _, sev, n in result.omitted if sev == "error")
        summary = (f"{result.total:,} finding(s), {errors:,} error(s) in {len(result.files)} file(s). "
                   if result.total else "No findings: nothing TPU-specific or outdated was found. ")
        if result.omitted:
            more = ", ".join(f"{rule} {n:,}" for rule, _, n in result.omitted)
            summary += (f"The table shows the first {len(shown):,} (and the first of every rule); "
                        f"{result.total - len(shown):,} more: {more}. `python -m migration check FILE` lists them all. ")
        summary += ("The Migrate tab's checklist grades the items about your training code from this check." if
                    kind == "training" else "The Serve tab's checklist grades the items about your serving code from "
                                            "this check.")
        state = dataclasses.replace(result, role=kind).to_dict()
        return (summary, gr.update(value=findings_frame(shown), visible=bool(findings)),
                *((state, gr.skip()) if kind == "training" else (gr.skip(), state)))


def code_sources(text: Any, files: Any) -> list[tuple[str, str]]:
    """(name, text) of the pasted source and the uploaded files, each within the per-file limit and
    at most `MAX_FILES` of them; CodeCheckError otherwise (reading a file costs I/O, never a parse)."""
    sources: list[tuple[str, str]] = []
    if isinstance(text, str) and text.strip():
        sources.append(("<pasted>", check_pasted(text)))
    elif text is not None and not isinstance(text, str):
        raise CodeCheckError(f"the pasted code must be text; got {type(text).__name__}")
    files = files or []
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise CodeCheckError(f"upload at most {MAX_FILES} .py files at once; got "
                             f"{len(files) if isinstance(files, list) else type(files).__name__}")
    for f in files:
        path = f if isinstance(f, str) else getattr(f, "name", None)
        if not isinstance(path, str):
            raise CodeCheckError("each upload must be a .py file")
        sources.append(read_upload(path))
    if not sources:
        raise CodeCheckError("Paste Python source or upload .py files to check")
    return sources
