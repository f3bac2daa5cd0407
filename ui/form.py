"""The Migrate form's components and its handlers' signatures, both built from the field table
(`migration.config.fields`): a field added there appears here, in its section's row, and as a
parameter of the API endpoints that take it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import gradio as gr
from gradio.components import Component

from migration.config.fields import FIELDS, Field, fields_of

# The form's panels, top to bottom: a title (None: always open) and the sections of its rows.
PANELS: tuple[tuple[str | None, tuple[str, ...]], ...] = (
    (None, ("source", "target", "cost")),
    ("Your model's dimensions, sharding and nodes (0: the preset's)", ("model", "nodes")),
    ("Advanced", ("choices", "extra runs", "checkpoint", "autotune")),
)
PLAN_FILE = "plan_file"  # not a field: a saved plan the run or autotune uses instead of the form's
# not a field: a MaxText yaml or Hugging Face config.json whose model (and TPU job) the plan and run take
CONFIG_FILE = "config_file"


def component(f: Field, defaults: dict[str, Any]) -> Component:
    """The field's input, starting at its default (or the page's own, from `defaults`)."""
    value = defaults.get(f.name, f.default)
    if f.kind in ("int", "float"):
        return gr.Number(value, label=f.label, **({"step": f.step} if f.step else {}))
    if f.kind in ("choice", "layout"):
        return gr.Dropdown(list(f.allowed()), value=value, label=f.label, allow_custom_value=True)
    if f.kind == "bool":
        return gr.Checkbox(value, label=f.label)
    return gr.Textbox(value, label=f.label, max_lines=1, placeholder=f.placeholder or None,
                      **({"scale": 2} if f.kind in ("text", "prices") else {}))


def section_row(section: str, defaults: dict[str, Any]) -> dict[str, Component]:
    """One row of the form: its section's fields in table order (the extra runs' row ends with the
    saved-plan upload)."""
    with gr.Row():
        built = {f.name: component(f, defaults) for f in FIELDS if f.section == section}
        if section == "extra runs":
            built[PLAN_FILE] = gr.File(label="…or run a saved plan (JSON from `python -m migration plan --json`)",
                                       file_types=[".json"], type="filepath")
        if section == "model":
            built[CONFIG_FILE] = gr.File(label="…or your MaxText yaml or Hugging Face config.json: read as data, it "
                                               "sets the model (and from MaxText the TPU job); what you change "
                                               "on the form wins", file_types=[".json", ".yml", ".yaml"],
                                         type="filepath", elem_id="config-file")
    return built


def form_rows(defaults: dict[str, Any]) -> dict[str, Component]:
    """Every panel's rows, by field name."""
    built: dict[str, Component] = {}
    for title, sections in PANELS:
        if title is None:
            for section in sections:
                built |= section_row(section, defaults)
            continue
        with gr.Accordion(title, open=False):
            for section in sections:
                built |= section_row(section, defaults)
    return built


def endpoint_inputs(endpoint: str, leading: tuple[str, ...] = ()) -> tuple[str, ...]:
    """An endpoint's input names after its states: `leading` (e.g. the saved plan), then its fields."""
    return (*leading, *(f.name for f in fields_of(endpoint)))


def takes_fields(endpoint: str, leading: tuple[str, ...] = (),
                 trailing: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Any]:
    """A streaming handler written as `method(self, *leading_values, values, *trailing_values, request)`
    (`values`: the endpoint's fields by name) is called by Gradio with one positional value per input;
    its signature names them, with their defaults, so the API does too (`None` for `leading` and
    `trailing`: an input added after the fields leaves every client's positional call as it was)."""
    names = [f.name for f in fields_of(endpoint)]

    def decorate(method: Callable[..., AsyncIterator[Any]]) -> Any:
        @functools.wraps(method)
        async def handler(self: Any, *args: Any) -> AsyncIterator[Any]:
            *given, request = args
            head, rest = given[:len(leading)], given[len(leading):]
            fields, tail = rest[:len(names)], [*rest[len(names):], *[None] * len(trailing)][:len(trailing)]
            async for update in method(self, *head, dict(zip(names, fields)), *tail, request):
                yield update

        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        handler.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
            inspect.Parameter("self", kind),
            *(inspect.Parameter(name, kind, default=None) for name in leading),
            *(inspect.Parameter(f.name, kind, default=f.default) for f in fields_of(endpoint)),
            *(inspect.Parameter(name, kind, default=None) for name in trailing),
            inspect.Parameter("request", kind, default=None, annotation=gr.Request)])
        handler.__annotations__ = {"request": gr.Request}
        del handler.__wrapped__  # Gradio reads the signature above, not the method's
        return handler

    return decorate
