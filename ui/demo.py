"""The page: a banner and the five tabs (Migrate, Serve, History, Code check, Environment), their events wired
in one order (the API's endpoints keep their order: a new tab's come last), over one `AppContext`."""

from __future__ import annotations

from typing import Any

import gradio as gr

from ui.code_check import code_check_tab, wire_code_check
from ui.context import AppContext
from ui.environment import environment_tab, wire_environment
from ui.history import HistoryHandlers, history_tab, refresh_after, wire_history
from ui.migrate import migrate_tab, wire_migrate
from ui.plan_run import JobHandlers
from ui.serve import ServeHandlers, serve_tab, wire_serve
from ui.settings import Settings, host_banner


class Blocks(gr.Blocks):
    """`gr.Blocks` whose API calls may leave out trailing parameters: each takes its component's starting
    value, the default the API advertises. A field added at the end of the field table
    (`migration.config.fields`) then leaves the positional calls of older API clients working.

    A call with fewer values than the event's API inputs reaches here without its states (Gradio places
    them only for a call that gives every API input): the values are completed, then the states placed."""

    def validate_inputs(self, block_fn: Any, inputs: list[Any]) -> None:
        api_inputs = [block for block in block_fn.inputs if not block.skip_api]
        if len(inputs) < len(api_inputs):
            values = iter([*inputs, *(getattr(block, "value", None) for block in api_inputs[len(inputs):])])
            inputs[:] = [None if block.skip_api else next(values) for block in block_fn.inputs]
        super().validate_inputs(block_fn, inputs)


def build_demo(settings: Settings | None = None) -> gr.Blocks:
    """The app's Blocks, with its job service as `demo.service` (for start-up and shutdown). ExecutorError
    when the settings name a Ray cluster that cannot be reached."""
    settings = settings or Settings()
    context = AppContext.create(settings)
    service = context.service
    with Blocks(title="TPU → GPU migration explorer", delete_cache=(3600, int(settings.export_max_age_s))) as demo:
        gr.Markdown("# TPU → GPU migration explorer")
        gr.Markdown(host_banner(settings) + (f"\n\n**Ray cluster:** {service.executor.describe()}; the others wait in "
                                             "the queue and see their position." if service.executor.remote else "")
                    + (f"\n\n{len(service.recovered)} job(s) that a previous server left "
                       "unfinished are marked interrupted in the History." if service.recovered else ""))
        migrate = migrate_tab(context.default_target)
        serve = serve_tab()
        history = history_tab(settings.multi_user)
        code_check = code_check_tab()
        environment = environment_tab()

        job_handlers = JobHandlers(context)
        job_events = wire_migrate(migrate, job_handlers)
        wire_code_check(code_check, context, migrate.code_state, serve.code_state)
        history_handlers = HistoryHandlers(context)
        wire_history(history, history_handlers)
        wire_environment(environment, context)
        job_events += wire_serve(serve, ServeHandlers(context), job_handlers.do_stop)
        refresh_after(job_events, history, history_handlers)
        demo.load(history_handlers.page_history, history.filters, [history.table, history.message],
                  api_visibility="private", queue=False)
    demo.service = service  # type: ignore[attr-defined]  # for start-up and shutdown
    return demo
