"""`lcap status`'s sections of capture: the proxies running for this LCAP_HOME (from the records they keep
current, capture/proxy/announce.py) and the turn writers with what waits in their spools."""

from __future__ import annotations

from dataclasses import asdict

from lcap.capture.storage.spool import backlogs
from lcap.capture.trust.credentials import running_proxies
from lcap.config import lcap_home
from lcap.processes import alive
from lcap.status import Section, View, age, section, size


@section("proxies")
def proxies(view: View) -> Section:
    s = Section(
        "proxies",
        ["address", "pid", "up", "episodes", "calling", "calls", "in flight", "stored", "conns", "store", "command"],
        empty="none running (`lcap proxy`, `lcap collect` and `lcap loop` start one)",
        wrap=("store", "command"),
    )
    data = []
    for record in running_proxies():
        c = record.counters
        stored = c.get("turns_stored", 0) + c.get("turns_degraded", 0)
        s.rows.append(
            [
                f"{record.host}:{record.port}",
                str(record.pid),
                age(view.now - record.started_at) if record.started_at else "-",
                str(c.get("episodes", 0)),
                str(c.get("episodes_in_flight", 0)),
                str(c.get("calls", 0)),
                str(c.get("calls_in_flight", 0)) + (f" ({held} held)" if (held := c.get("calls_held", 0)) else ""),
                f"{stored}/{c.get('turns_spooled', 0)}",
                str(c.get("connections", 0)),
                record.db,
                record.command,
            ]
        )
        if held:
            s.notes.append(
                f"the proxy on port {record.port} holds {held} (calls, and Responses WebSocket openings) until a "
                "restarting policy replica serves again; its --hold-timeout answers them 503"
            )
        if dropped := c.get("episode_rows_dropped", 0):
            s.notes.append(
                f"the proxy on port {record.port} lost the rows of {dropped} session episodes (their turns are stored; "
                "see its log)"
            )
        data.append({k: v for k, v in asdict(record).items() if k != "key"})  # the key stays in its 0600 file
    s.data = data
    return s


@section("writers")
def writers(view: View) -> Section:
    """Each spool with its proxy, the writer storing it, and what still waits for the store."""
    s = Section(
        "turn writers",
        ["spool", "proxy", "writer", "waiting", "oldest", "stored", "degraded", "dead", "store"],
        empty="no spool",
        wrap=("store",),
    )
    writer_of = {r.spool: r.counters.get("writer_pid") for r in running_proxies() if r.spool}
    data = []
    for spool in backlogs(lcap_home() / "spool"):
        owner_alive = spool.owner is not None and alive(spool.owner)
        writer = writer_of.get(str(spool.directory))
        s.rows.append(
            [
                spool.directory.name,
                f"{spool.owner}" + ("" if owner_alive else " (ended)"),
                str(writer) if writer else "-",
                f"{spool.waiting} ({size(spool.waiting_bytes)})",
                age(view.now - spool.oldest) if spool.waiting and spool.oldest else "-",
                str(spool.stored),
                str(spool.degraded),
                str(spool.dead),
                spool.store or "?",
            ]
        )
        if spool.waiting and not owner_alive:
            s.notes.append(
                f"{spool.waiting} turns of an ended proxy wait in {spool.directory}: the next lcap proxy on "
                f"{spool.store} stores them (`lcap doctor spool` says more)"
            )
        data.append(
            {
                "directory": str(spool.directory),
                "owner": spool.owner,
                "owner_running": owner_alive,
                "writer_pid": writer,
                "waiting": spool.waiting,
                "waiting_bytes": spool.waiting_bytes,
                "oldest_waiting": spool.oldest if spool.waiting else None,
                "stored": spool.stored,
                "degraded": spool.degraded,
                "dead_letters": spool.dead,
                "store": spool.store,
            }
        )
    s.data = data
    return s
