"""`lcap doctor`'s checks of the core: the store (opens, schema version, what capture could not store as it
was) and the optional Ray install. The stages' checks live in their own `doctor.py`."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any

from lcap.config import LcapError
from lcap.doctor import Context, Result, check
from lcap.schema import SCHEMA_VERSION
from lcap.store import Store, table_names

STORE_TIMEOUT = 5.0  # seconds the doctor waits for a store another process holds


def _store_facts(ctx: Context) -> dict[str, Any]:
    """The store's counts, read once, read-only (never creating or migrating it)."""

    def read() -> dict[str, Any]:
        store = Store(ctx.db, timeout=STORE_TIMEOUT)
        with store.connect(read_only=True) as con:
            tables = table_names(con)

            def count(sql: str, table: str) -> int:
                if table not in tables:
                    return 0
                row = con.execute(sql).fetchone()
                return int(row[0] or 0) if row else 0

            version = count("SELECT max(version) FROM schema_version", "schema_version") or 1
            return {
                "version": version,
                "episodes": count("SELECT count(*) FROM episodes", "episodes"),
                "turns": count("SELECT count(*) FROM turns", "turns"),
                "dead_letters": count("SELECT count(*) FROM dead_letters", "dead_letters"),
                "degraded": count("SELECT count(*) FROM turns WHERE degraded IS NOT NULL", "turns")
                if version >= 3
                else 0,
                "unstored": count(
                    "SELECT count(DISTINCT episode_id) FROM episode_flags WHERE flag = 'turns_unstored'",
                    "episode_flags",
                ),
            }

    return ctx.once("store", read)


@check("store.open", section="store", required=True, timeout=STORE_TIMEOUT + 30)
def store_opens(ctx: Context) -> Result:
    if not ctx.db.exists():
        return Result.skip(
            f"no store at {ctx.db} yet: the first `lcap proxy` or `lcap collect` makes it (--db names another)"
        )
    try:
        facts = _store_facts(ctx)
    except LcapError as exc:
        text = str(exc)
        if "locked" in text:
            fix = (
                "another process keeps it open (a DuckDB shell, a notebook, `lcap sql --write` in progress): close it; "
                "lcap's own processes hold it only for a moment"
            )
        else:
            fix = f"is {ctx.db} a DuckDB file lcap wrote? restore it, or point --db at another store"
        return Result.fail(text, fix)
    return Result.ok(f"{ctx.db}: {facts['episodes']} episodes, {facts['turns']} turns", **facts)


@check("store.schema", section="store", required=True, needs=("store.open",))
def store_schema(ctx: Context) -> Result:
    version = _store_facts(ctx)["version"]
    if version > SCHEMA_VERSION:
        return Result.fail(
            f"schema version {version}: this lcap knows up to {SCHEMA_VERSION}",
            "upgrade lcap (a newer lcap wrote this store)",
            version=version,
        )
    if version < SCHEMA_VERSION:
        return Result.ok(f"schema version {version}, brought to {SCHEMA_VERSION} on its next write", version=version)
    return Result.ok(f"schema version {version} (current)", version=version)


@check("store.capture", section="store", required=False, needs=("store.open",))
def store_capture_losses(ctx: Context) -> Result:
    """Turns capture stored degraded, records kept only as dead letters, episodes whose turns were not all stored."""
    facts = _store_facts(ctx)
    dead, degraded, unstored = facts["dead_letters"], facts["degraded"], facts["unstored"]
    if not (dead or degraded or unstored):
        return Result.ok("every captured call is stored as it was (no dead letters, no degraded turns)")
    return Result.warn(
        f"{dead} dead letters, {degraded} degraded turns, {unstored} episodes flagged turns_unstored",
        'see why: lcap sql "select turn_id, stored_as, reason from dead_letters"; '
        "turns_unstored ones are written by the next lcap proxy on this store",
        dead_letters=dead,
        degraded=degraded,
        unstored=unstored,
    )


@check("ray", section="optional", required=False)
def ray_installed(ctx: Context) -> Result:
    if importlib.util.find_spec("ray") is None:
        return Result.fail(
            "Ray is not installed in lcap's environment (needed only to spread collect, serve or train over a cluster)",
            'pip install -e ".[ray]" in lcap\'s checkout (scripts/setup.sh does it)',
        )
    try:
        version = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown version"
    return Result.ok(f"Ray {version}", version=version)
