"""The page's tables: each sized to its content, so that no header wraps letter by letter, no cell is cut
off and no last row hides in a scroll box inside the page. One helper builds them all."""

from __future__ import annotations

from typing import Any

import gradio as gr

# The page's sizing rules (`ui.launch`): a table's header breaks between words, never inside one; a file's
# whole name shows, wrapped, never cut to "report-transformer-tiny-202… .csv".
PAGE_CSS = """
th .header.text { word-break: normal !important; overflow-wrap: normal !important; hyphens: none; }
.file-preview .filename { overflow: visible !important; }
.file-preview .filename .stem { white-space: normal !important; overflow-wrap: anywhere; }
"""
NO_INNER_SCROLL = 100_000  # px: a table grows with its rows; the page scrolls, never a box inside it


def widths(*shares: float) -> list[str]:
    """Column widths as percentages of the table, from relative shares (a header's longest word, a cell's
    usual text): `widths(1, 3)` gives ["25%", "75%"]."""
    total = sum(shares)
    return [f"{100 * s / total:.1f}%" for s in shares]


def table(label: str, shares: tuple[float, ...] | None = None, **kwargs: Any) -> gr.Dataframe:
    """A read-only table that wraps its cells at spaces, never scrolls inside the page, and gives each column
    its share of the width (`shares`, one per column, where the columns are known when it is built)."""
    kwargs.setdefault("visible", False)
    return gr.Dataframe(label=label, wrap=True, max_height=NO_INNER_SCROLL, interactive=False,
                        column_widths=widths(*shares) if shares else None, **kwargs)


def shaped(frame: Any, shares: tuple[float, ...], **kwargs: Any) -> Any:
    """An update that shows `frame` with its columns' shares (a table that shows frames of different columns)."""
    return gr.update(value=frame, visible=True, column_widths=widths(*shares), **kwargs)
