"""The History tab: the runs and plans recorded (training and serving), filtered; rows clicked into a
selection; the selected training runs compared side by side (table, throughput, peak memory, loss) and
exported as CSV, or the whole history.

Whose entries a request may read is decided here (`HistoryHandlers.scope_user`): its user's own, or
everyone's on a single-user box, for an admin, or on a history the operator declared team-visible.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gradio as gr

from migration.config import forms
from migration.common import ConfigError
from migration.service.history import EXPORT_MAX_ROWS, KINDS, HistoryError
from ui.context import AppContext, refuse, user_of
from ui import tables
from ui.frames import HISTORY_COLUMNS, bar_limits, compare_frames, history_frame
from workloads import WORKLOADS

# The columns' shares of the table's width (ui.frames.HISTORY_COLUMNS)
HISTORY_SHARES = (35, 100, 50, 85, 50, 110, 100, 80, 100, 95, 60, 95, 105, 75)  # px at the page's width: the longest word
COMPARE_MAX = 16  # runs side by side in one comparison
HISTORY_STATUSES = ("ok", "failed", "cancelled", "infeasible", "interrupted", "queued", "running")


@dataclasses.dataclass
class HistoryTab:
    filters: list[gr.Dropdown]  # scope, kind, workload, status: the inputs of /history
    refresh: gr.Button
    table: gr.Dataframe
    ids: gr.Textbox
    buttons: dict[str, gr.Button]  # compare, export_selected, export_all
    message: gr.Markdown  # what the last button did, or why it could not: beside the buttons
    export_file: gr.File
    compare: list[gr.components.Component]  # table, throughput, memory, loss: the outputs of /compare


def history_tab(multi_user: bool) -> HistoryTab:
    with gr.Tab("History"):
        with gr.Row():
            filters = [gr.Dropdown(["mine", "everyone"], value="mine", label="Whose", allow_custom_value=True,
                                   info=None if multi_user else "single-user box: one shared history"),
                       gr.Dropdown(["all", *KINDS], value="all", label="Kind", allow_custom_value=True),
                       gr.Dropdown(["all", *WORKLOADS], value="all", label="Workload", allow_custom_value=True),
                       gr.Dropdown(["all", *HISTORY_STATUSES], value="all", label="Status", allow_custom_value=True)]
            refresh = gr.Button("Refresh")
        table = tables.table("Runs and plans: click rows to select them", HISTORY_SHARES, headers=HISTORY_COLUMNS,
                             elem_id="history-table", visible=True)
        with gr.Row():
            ids = gr.Textbox("", label="Selected ids (click rows above, or type: 3,5)", scale=2)
            buttons = {"compare": gr.Button("Compare selected"),
                       "export_selected": gr.Button("Export selected (CSV)"),
                       "export_all": gr.Button("Export all shown (CSV)")}
        message = gr.Markdown("", elem_id="history-message", label="History message", show_label=False)
        export_file = gr.File(label="CSV export", visible=False)
        return HistoryTab(filters, refresh, table, ids, buttons, message, export_file, compare=comparison())


def comparison() -> list[gr.components.Component]:
    """The comparison's outputs, hidden until a comparison is drawn."""
    table = tables.table("Side by side", HISTORY_SHARES, elem_id="compare-table")
    with gr.Row():
        throughput = gr.BarPlot(x="run", y="samples_per_s", title="Throughput (samples/s), from zero", height=280,
                                y_lim=[0, None], x_label_angle=0, x_title="run", y_title="samples/s",
                                visible=False, elem_id="compare-throughput", label="Throughput", show_label=False)
        memory = gr.BarPlot(x="bar", y="peak", color="series", title="Peak memory per device: compiled and measured",
                            y_lim=[0, None], x_label_angle=-30, x_title="", y_title="GiB",
                            height=280, visible=False, elem_id="compare-memory", label="Peak memory", show_label=False)
    loss = gr.LinePlot(x="step", y="loss", color="run", title="Loss", height=280, visible=False, x_label_angle=0,
                       elem_id="compare-loss", label="Loss", show_label=False)
    return [table, throughput, memory, loss]


def wire_history(tab: HistoryTab, handlers: HistoryHandlers) -> None:
    """Refresh, a row clicked, Compare and the two exports (the page's load fills the table: `ui.demo`)."""
    scope = tab.filters[0]
    # The API's endpoints keep their outputs and answer a bad call with an error; they hang on a button the
    # page does not show. The page's buttons call their twins (`page_*`), which put every refusal in the
    # message beside the buttons: an unqueued event's error would reach the page as an HTTP 500 without it.
    api = gr.Button(visible=False)
    api.click(handlers.do_history, tab.filters, tab.table, api_name="history", queue=False)
    api.click(handlers.do_compare, [tab.ids, scope], tab.compare, api_name="compare", queue=False)
    api.click(handlers.do_export, [tab.ids, scope], tab.export_file, api_name="export_csv", queue=False)
    api.click(handlers.do_export_all, scope, tab.export_file, api_name="export_history_csv", queue=False)
    private = {"api_visibility": "private", "queue": False}
    tab.refresh.click(handlers.page_history, tab.filters, [tab.table, tab.message], **private)
    tab.table.select(handlers.do_select, tab.ids, tab.ids, **private)
    tab.buttons["compare"].click(handlers.page_compare, [tab.ids, scope], [tab.message, *tab.compare], **private)
    tab.buttons["export_selected"].click(handlers.page_export, [tab.ids, scope], [tab.export_file, tab.message],
                                         **private)
    tab.buttons["export_all"].click(handlers.page_export_all, scope, [tab.export_file, tab.message], **private)


def refresh_after(events: list[Any], tab: HistoryTab, handlers: HistoryHandlers) -> None:
    """The History's table brought up to date when a plan, a run or a serving job of this page ends (its
    entry was written when it ended), with the filters as they are."""
    for event in events:
        event.then(handlers.page_history, tab.filters, [tab.table, tab.message], api_visibility="private",
                   queue=False)


class HistoryHandlers:
    """The tab's events: /history, /compare, /export_csv, /export_history_csv (which raise their refusals,
    for API clients), their page twins `page_*` (which never raise: each refusal is the line beside the
    buttons), and a row clicked."""

    def __init__(self, context: AppContext):
        self.context = context

    def scope_user(self, scope: str, request: gr.Request | None) -> str | None:
        """Whose entries a request may read: its user's; everyone's (None) on a single-user box, for
        an admin, or on a team-visible history; anyone else asking for everyone's is refused."""
        forms.choice(scope, "scope", ("mine", "everyone"))
        user = user_of(request)
        settings = self.context.settings
        if not settings.multi_user:
            return None
        if scope == "mine":
            return user
        if settings.team_history or user in settings.admins:
            return None
        raise ConfigError("scope", "everyone's history is open only to the admins this server names (--admins) or "
                                   "on a team-visible history (--team-history); use mine")

    def do_history(self, scope, kind, workload, status, request: gr.Request):
        try:
            user = self.scope_user(scope, request)
            for field, value, allowed in (("kind", kind, ("all", *KINDS)),
                                          ("workload", workload, ("all", *WORKLOADS)),
                                          ("status", status, ("all", *HISTORY_STATUSES))):
                forms.choice(value, field, allowed)
            entries = self.context.history.entries(kind=None if kind == "all" else kind,
                                                   workload=None if workload == "all" else workload,
                                                   status=None if status == "all" else status, user=user,
                                                   payload=False)
        except (ConfigError, HistoryError) as exc:
            raise refuse(exc)
        return history_frame(entries)

    def do_select(self, ids_text, evt: gr.SelectData):
        """Clicking a row of the History table adds its id to the selection (again: removes it)."""
        row = evt.row_value if evt.row_value is not None else []
        if not row:
            return gr.skip()
        try:
            chosen = parse_ids(ids_text)
        except ConfigError:
            chosen = []
        entry_id = int(row[0])
        chosen = [i for i in chosen if i != entry_id] if entry_id in chosen else [*chosen, entry_id]
        return ",".join(map(str, chosen))

    def do_compare(self, ids_text, scope, request: gr.Request):
        try:
            ids = parse_ids(ids_text)
            if len(ids) > COMPARE_MAX:
                raise ConfigError("ids", f"compare at most {COMPARE_MAX} runs at once; got {len(ids)}")
            entries = (self.context.history.entries(kind="run", ids=ids, user=self.scope_user(scope, request))
                       if ids else [])
        except (ConfigError, HistoryError) as exc:
            raise refuse(exc)
        if len(entries) < 2:
            found = {e["id"] for e in entries}
            others = [i for i in dict.fromkeys(ids) if i not in found]
            why = (f"; {', '.join(f'#{i}' for i in others)} {'is' if len(others) == 1 else 'are'} not training runs "
                   "of yours (plans and serving jobs have no steps to compare)" if others else "")
            raise gr.Error(f"Select two or more training runs to compare (click their rows in the table, or type "
                           f"their ids); {'nothing is selected' if not ids else f'the selection has {len(entries)} run(s)'}"
                           f"{why}.", print_exception=False)
        table, throughput, memory, losses = compare_frames(list(reversed(entries)))
        return (gr.update(value=table, visible=True),
                gr.update(value=throughput, visible=True, sort=list(throughput["run"]),
                          y_lim=bar_limits(throughput, "samples_per_s")),
                gr.update(value=memory, visible=True, y_title=memory.attrs["unit"], y_lim=bar_limits(memory, "peak")),
                gr.update(value=losses, visible=True))

    def do_export(self, ids_text, scope, request: gr.Request):
        try:
            ids = parse_ids(ids_text) or None
            if ids is not None and len(ids) > EXPORT_MAX_ROWS:
                raise ConfigError("ids", f"export at most {EXPORT_MAX_ROWS} entries at once; got {len(ids)}")
            path = self.context.export_path("history" if ids is None else "selection", user_of(request))
            self.context.history.to_csv(ids=ids, path=path, user=self.scope_user(scope, request),
                                        viewer=user_of(request))
        except (ConfigError, HistoryError, OSError) as exc:
            raise refuse(exc)
        return gr.update(value=str(path), visible=True)

    def do_export_all(self, scope, request: gr.Request):
        return self.do_export("", scope, request)

    # -- the page's twins: every refusal is the message beside the buttons, never an HTTP 500 ----------

    def page_history(self, scope, kind, workload, status, request: gr.Request):
        try:
            return self.do_history(scope, kind, workload, status, request), ""
        except gr.Error as exc:
            return gr.skip(), f"⚠️ {exc.message}"

    def page_compare(self, ids_text, scope, request: gr.Request):
        try:
            shown = self.do_compare(ids_text, scope, request)
        except gr.Error as exc:
            return (f"⚠️ {exc.message}", *(gr.update(visible=False) for _ in range(4)))
        runs = ", ".join(f"#{i}" for i in parse_ids(ids_text))
        return (f"Comparing {runs}: the table, throughput, peak memory and loss below.", *shown)

    def page_export(self, ids_text, scope, request: gr.Request):
        try:
            return self.do_export(ids_text, scope, request), f"Exported {'the selection' if ids_text else 'the history'}."
        except gr.Error as exc:
            return gr.skip(), f"⚠️ {exc.message}"

    def page_export_all(self, scope, request: gr.Request):
        return self.page_export("", scope, request)


def parse_ids(text: str) -> list[int]:
    parts = [p for p in (text or "").replace(" ", "").replace("#", "").split(",") if p]
    if not all(p.isdigit() and len(p) < 12 for p in parts):
        raise ConfigError("ids", f"must be run ids from the History table separated by commas, like 3,5; got {text!r}")
    return [int(p) for p in parts]
