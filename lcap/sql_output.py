"""Render query results for `lcap sql`: a rich table for people, CSV or JSON lines for pipes."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any


def _plain(value: Any) -> Any:
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    return value


def render(columns: Sequence[str], rows: Sequence[tuple], fmt: str) -> str:
    if fmt == "json":
        return "".join(json.dumps(dict(zip(columns, map(_plain, row))), default=str) + "\n" for row in rows)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(columns)
        writer.writerows([[_plain(v) for v in row] for row in rows])
        return out.getvalue()
    from rich.console import Console
    from rich.table import Table

    table = Table(*columns, show_lines=False)
    for row in rows:
        table.add_row(*("NULL" if v is None else str(_plain(v)) for v in row))
    out = io.StringIO()
    Console(file=out, width=200).print(table)
    out.write(f"({len(rows)} row{'s' if len(rows) != 1 else ''})\n")
    return out.getvalue()
