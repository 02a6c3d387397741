"""Render query results for `lcap sql`: a table for people, CSV or JSON lines for pipes.

CSV and JSON keep every value exactly. The table is for reading: floats rounded (lcap.display.readable), long
values cut with an ellipsis at `max_width` characters, and text shown as it is, never interpreted: no markup,
control characters (an agent's ANSI escapes, newlines) written as escapes.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from lcap.display import printable, readable

DEFAULT_MAX_WIDTH = 80  # characters of one table cell
ELLIPSIS = "…"


def _plain(value: Any) -> Any:
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def render(columns: Sequence[str], rows: Sequence[tuple], fmt: str, *, max_width: int = DEFAULT_MAX_WIDTH) -> str:
    if fmt == "json":
        return "".join(json.dumps(dict(zip(columns, map(_plain, row))), default=str) + "\n" for row in rows)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(columns)
        writer.writerows([[_plain(v) for v in row] for row in rows])
        return out.getvalue()
    # start-up: rich (the CLI loads this module for its default width)
    from rich.cells import cell_len
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    limit = max_width if max_width > 0 else None
    numeric = [
        bool(rows) and all(isinstance(r[i], (int, float, Decimal)) or r[i] is None for r in rows)
        for i in range(len(columns))
    ]
    headers = [cell(name, limit) for name in columns]
    cells = [[cell(v, limit) for v in row] for row in rows]
    table = Table(show_lines=False)
    for name, is_number in zip(headers, numeric):
        table.add_column(Text(name), justify="right" if is_number else "left", no_wrap=True, overflow="ellipsis")
    for row, texts in zip(rows, cells):
        table.add_row(*(Text(text, style="dim" if v is None else "") for v, text in zip(row, texts)))
    # As wide as the table needs: a narrower console would squeeze every column, headers included, to an ellipsis.
    widths = [max([cell_len(h), *(cell_len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    out = io.StringIO()
    Console(file=out, width=sum(widths) + 3 * len(widths) + 1).print(table)
    out.write(f"({len(rows)} row{'s' if len(rows) != 1 else ''})\n")
    return out.getvalue()


def cell(value: Any, max_width: int | None = DEFAULT_MAX_WIDTH) -> str:
    """One value as a table shows it: rounded, escaped and cut to `max_width` characters (None: whole)."""
    text = _show(value, top=True, budget=max_width + 1 if max_width else None)
    if max_width and len(text) > max_width:
        text = text[: max_width - 1] + ELLIPSIS
    return text


def _show(value: Any, *, top: bool, budget: int | None) -> str:
    """`value` as text; a long list or map stops once `budget` characters are written (it is cut anyway)."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (float, Decimal)):
        return readable(float(value))
    if isinstance(value, str):
        text = printable(value)
        return text if top else json.dumps(text, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return _joined("[", ((None, v) for v in value), "]", budget)
    if isinstance(value, dict):
        return _joined("{", value.items(), "}", budget)
    return printable(str(_plain(value)))


def _joined(open_: str, items: Any, close: str, budget: int | None) -> str:
    parts, used = [], len(open_)
    for key, item in items:
        shown = _show(item, top=False, budget=budget)
        part = shown if key is None else f"{_show(key, top=False, budget=budget)}: {shown}"
        parts.append(part)
        used += len(part) + 2
        if budget is not None and used > budget:
            return open_ + ", ".join(parts) + ELLIPSIS  # cut by the caller
    return open_ + ", ".join(parts) + close
