"""`lcap sql`'s table (the command itself: tests/integration/test_sql.py)."""

from __future__ import annotations

from lcap.sql_output import ELLIPSIS, render


def test_a_wide_table_keeps_every_header_and_value_whole():
    """Computed columns have long names: a table wider than a console's width was squeezed, headers cut to `…` or
    blank (#51 row 10). Each header and each value short of --max-width is shown whole."""
    columns = [
        "task_id",
        "count_star()",
        "round(avg(CAST(COALESCE(exit_code, 0) AS DOUBLE)), 3)",
        "count_star() FILTER (WHERE (status = 'ok'))",
        "max(started_at)",
        "string_agg(command, ',')",
        "list(episode_id)",
    ]
    row = ("t1", 1, 0.25, 1, "2026-12-06T14:49:03.230697+00:00", "python agent.py --word button", ["e1"])
    table = render(columns, [row], "table")
    header, value = table.splitlines()[1], table.splitlines()[3]
    assert [h.strip() for h in header.strip("┃").split("┃")] == columns
    assert "python agent.py --word button" in value and "2026-12-06T14:49:03.230697+00:00" in value
    assert ELLIPSIS not in table
