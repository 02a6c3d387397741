"""`lcap ui`'s web app: Starlette routes over the store, rendered with Jinja2 templates.

Pages are rendered on the server from read-only queries (lcap.ui.queries); the browser gets HTML,
one vendored chart library, one small script (charts, live refresh, raw bodies on demand) and one
stylesheet. Everything captured is untrusted (agent output, tool arguments, model names, task ids):
the templates autoescape it, and a Content-Security-Policy that allows only the app's own scripts
keeps a missed escape from running anything.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import threading
import time
from datetime import datetime
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

import duckdb
import jinja2
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lcap.config import LcapError
from lcap.ui import queries
from lcap.ui.conversation import conversation, pretty
from lcap.ui.options import UiOptions
from lcap.ui.reader import Reader, Watch
from lcap.ui.tokens import Tokenizers, token_view

HERE = Path(__file__).resolve().parent
COOKIE = "lcap_ui_token"
MAX_LISTENERS = 32  # live pages (EventSource streams) served at once; more get 503 and retry
HEARTBEAT_SECONDS = 15.0
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "font-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


def create_app(db: Path, options: UiOptions, *, token: str | None, max_listeners: int = MAX_LISTENERS) -> Starlette:
    """The UI over the store at `db`. With a `token`, every request must carry it (cookie, ?token= or Bearer)."""
    reader = Reader(Path(db), timeout=options.store_timeout)
    watch = Watch(reader, options.poll)
    tokenizers = Tokenizers(options.tokenizer)
    templates = Jinja2Templates(env=_environment())
    listeners = threading.BoundedSemaphore(max_listeners)  # taken without waiting: the app's one event loop

    def page(request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
        context = {"db": str(db), "poll_ms": int(options.poll * 1000), **context}
        return templates.TemplateResponse(request, name, context, status_code=status)

    def error(request: Request, title: str, message: str, status: int) -> Response:
        return page(request, "error.html", {"title": title, "message": message}, status)

    def failed(request: Request, exc: Exception, status: int = 503) -> Response:
        return error(request, "Store unavailable", str(exc), status)

    def overview(request: Request) -> Response:
        try:
            with reader.read() as (con, cols):
                data = queries.overview(con, cols)
        except LcapError as exc:
            return failed(request, exc)
        return page(request, "overview.html", {"title": "Overview", "o": data, "charts": _overview_charts(data)})

    def episodes(request: Request) -> Response:
        started = time.perf_counter()
        try:
            with reader.read() as (con, cols):
                flags = queries.flag_names(con, cols)
                f = queries.EpisodeFilter.from_query(dict(request.query_params), set(flags))
                rows, total = queries.episode_page(con, f, cols)
                choices = queries.filter_choices(con)
        except LcapError as exc:
            return failed(request, exc)
        queried = time.perf_counter()
        pages = max(1, math.ceil(total / f.per_page))
        response = page(
            request,
            "episodes.html",
            {
                "title": "Episodes",
                "f": f,
                "rows": rows,
                "total": total,
                "pages": pages,
                "flags": flags,
                "optional": queries.optional_turn_flags(cols),
                "choices": choices,
                "statuses": queries.STATUSES,
                "page_sizes": queries.PAGE_SIZES,
            },
            400 if f.errors else 200,
        )
        done = time.perf_counter()  # the template is rendered by now
        response.headers["Server-Timing"] = (
            f"db;dur={(queried - started) * 1000:.1f}, total;dur={(done - started) * 1000:.1f}"
        )
        return response

    def episode(request: Request) -> Response:
        episode_id = request.query_params.get("id", "")
        try:
            with reader.read() as (con, cols):
                ep = queries.episode(con, episode_id)
                if ep is None:
                    return error(request, "No such episode", f"no episode {episode_id!r} in this store", 404)
                extras = queries.episode_extras(con, episode_id)
                turns, n_turns = queries.episode_turns(con, episode_id, cols)
                tokens = queries.episode_tokens(con, episode_id)
                deployments = sorted({d for d in tokens.column("deployment").to_pylist() if d})
                bases = queries.base_models(con, deployments)
                members = (
                    queries.group(con, ep["round"], ep["split"], ep["task_id"]) if ep.get("task_id") is not None else []
                )
        except LcapError as exc:
            return failed(request, exc)
        return page(
            request,
            "episode.html",
            {
                "title": f"Episode {episode_id}",
                "ep": ep,
                "extras": extras,
                "views": conversation(turns),
                "n_turns": n_turns,
                "max_turns": queries.MAX_TURNS,
                "tokens": token_view(tokens, tokenizers, bases),
                "members": members,
                "optional": queries.optional_turn_flags(cols),
                "live": ep.get("status") == "running" or ep.get("reward") is None,
            },
        )

    def group(request: Request) -> Response:
        q = request.query_params
        try:
            round_ = int(q["round"]) if q.get("round") else None
        except ValueError:
            return error(request, "Bad group", "round must be a number", 400)
        split, task = q.get("split") or "train", q.get("task") or ""
        try:
            with reader.read() as (con, cols):
                members = queries.group(con, round_, split, task)
                rewarded = [m for m in members if m["reward"] is not None]

                def viewed(m: dict[str, Any]) -> dict[str, Any]:
                    return {**m, "views": conversation(queries.episode_turns(con, m["episode_id"], cols)[0])}

                best, worst = (viewed(rewarded[0]), viewed(rewarded[-1])) if len(rewarded) >= 2 else (None, None)
        except LcapError as exc:
            return failed(request, exc)
        rewards = [m["reward"] for m in rewarded]
        return page(
            request,
            "group.html",
            {
                "title": f"Group {round_}/{split}/{task}",
                "round": round_,
                "split": split,
                "task": task,
                "members": members,
                "best": best,
                "worst": worst,
                "mean": sum(rewards) / len(rewards) if rewards else None,
                "live": any(m["status"] == "running" or m["reward"] is None for m in members),
            },
        )

    def raw(request: Request) -> Response:
        part = request.query_params.get("part", "request")
        if part not in ("request", "response"):
            return PlainTextResponse("part must be request or response", 400)
        try:
            with reader.read() as (con, _):
                found, body = queries.raw_turn(con, request.query_params.get("turn", ""), part)
        except LcapError as exc:
            return PlainTextResponse(str(exc), 503)
        if not found:
            return PlainTextResponse("no such turn", 404)
        text = body if isinstance(body, str) else json.dumps(body)
        return Response(text or "null", media_type="application/json")

    async def events(request: Request) -> Response:
        """Server-sent events: `change` with the store's fingerprint whenever it moves, `busy` when unreadable, `end`
        before the stream closes after `--stream-seconds` (the browser then reconnects)."""
        if not listeners.acquire(blocking=False):
            return PlainTextResponse("too many live pages open; retrying", 503, headers={"Retry-After": "5"})

        async def stream():
            try:
                yield f"retry: {int(max(options.poll, 1) * 1000)}\n\n"
                last: tuple[int, ...] | None = None
                ends = time.monotonic() + options.stream_seconds
                beat = time.monotonic()
                while time.monotonic() < ends:
                    value, error = await watch.current()
                    if error:
                        yield f"event: busy\ndata: {json.dumps(error)}\n\n"
                    elif value != last:
                        yield f"event: change\ndata: {json.dumps(list(value or ()))}\n\n"
                        last = value
                        beat = time.monotonic()
                    elif time.monotonic() - beat > HEARTBEAT_SECONDS:
                        yield ": ping\n\n"
                        beat = time.monotonic()
                    await asyncio.sleep(options.poll)  # a client that leaves cancels this (Starlette watches)
                yield "event: end\ndata: {}\n\n"  # a planned end: the page reconnects without saying so
            finally:
                listeners.release()

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        )

    routes = [
        Route("/", overview),
        Route("/episodes", episodes),
        Route("/episode", episode),
        Route("/group", group),
        Route("/raw", raw),
        Route("/events", events),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    loopback_hosts = ["127.0.0.1", "localhost", "::1", "[::1]"]
    middleware = [
        Middleware(_Headers),
        # Loopback: refuse other Host names, so a page on another site cannot read the UI by DNS rebinding.
        Middleware(TrustedHostMiddleware, allowed_hosts=loopback_hosts if options.loopback else ["*"]),
    ]
    if token:
        middleware.append(Middleware(_TokenGate, token=token))

    async def store_error(request: Request, exc: Exception) -> Response:
        """A query the store cannot answer (a store from an lcap without some table): the page says which."""
        message = f"the store could not answer this page: {str(exc).splitlines()[0]}"
        return error(request, "Store error", message, 500)

    return Starlette(routes=routes, middleware=middleware, exception_handlers={duckdb.Error: store_error})


class _Headers:
    """Security headers on every answer: the CSP, no sniffing, no framing, no referrer, no caching of pages."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = scope["path"].startswith("/static/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [
                    (b"content-security-policy", CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"x-frame-options", b"DENY"),
                    (b"referrer-policy", b"no-referrer"),
                    (b"cross-origin-resource-policy", b"same-origin"),
                ]
                if not static:
                    headers.append((b"cache-control", b"no-store"))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)


class _TokenGate:
    """Every request carries the token: a cookie set on the first visit with `?token=` (then the token
    leaves the address bar), or `Authorization: Bearer`. Compared in constant time."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        cookie = SimpleCookie()
        try:
            cookie.load(headers.get("cookie", ""))
        except Exception:
            cookie = SimpleCookie()
        bearer = headers.get("authorization", "")
        given = [
            cookie[COOKIE].value if COOKIE in cookie else "",
            bearer[7:] if bearer.lower().startswith("bearer ") else "",
        ]
        if any(secrets.compare_digest(g.encode(), self.token.encode()) for g in given if g):
            await self.app(scope, receive, send)
            return
        if secrets.compare_digest(query.get("token", "").encode(), self.token.encode()):
            rest = urlencode([(k, v) for k, v in parse_qsl(scope.get("query_string", b"").decode()) if k != "token"])
            location = scope["path"] + (f"?{rest}" if rest else "")
            response: Response = Response(status_code=303, headers={"Location": location})
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict", path="/")
        else:
            response = PlainTextResponse("lcap ui: open the address with ?token=... that `lcap ui` printed", 401)
        await response(scope, receive, send)


# --- templates --------------------------------------------------------------------------------------


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,  # every template, whatever its name: all captured text is untrusted
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(num=_num, ms=_ms, when=_when, secs=_secs, pretty=pretty, qs=_qs, short=_short)
    return env


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}g}"
    return str(value)


def _ms(value: Any) -> str:
    return "–" if value is None else (f"{value:,.0f} ms" if value >= 10 else f"{value:.1f} ms")


def _secs(value: Any) -> str:
    if value is None:
        return "–"
    return f"{value:.1f} s" if value < 120 else f"{value / 60:.1f} min"


def _when(value: Any) -> str:
    if isinstance(value, datetime):
        return value.astimezone().strftime("%Y-%m-%d %H:%M:%S")
    return "–" if value is None else str(value)


def _qs(items: dict[str, Any]) -> str:
    return urlencode({k: v for k, v in items.items() if v is not None and v != ""})


def _short(value: Any, n: int = 80) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= n else text[: n - 1] + "…"


# --- charts -----------------------------------------------------------------------------------------


def _overview_charts(o: dict[str, Any]) -> list[dict[str, Any]]:
    """Chart specs (labels and series) for the overview; the browser draws them with Chart.js."""
    charts: list[dict[str, Any]] = []

    def chart(id: str, title: str, type: str, labels: list, series: list, stacked: bool = False, **more: Any) -> None:
        spec = {"id": id, "title": title, "type": type, "labels": labels, "series": series, **more}
        charts.append({**spec, "stacked": True} if stacked else spec)

    if o["rewards"]:
        finished = [r for r in o["rewards"] if not r.get("running")]  # a round still running: its mean is partial
        rounds, series = _by_round(finished, "split", "mean")
        partial = ", ".join(f"round {r['round']} {r['split']}" for r in o["rewards"] if r.get("running"))
        title = "Mean reward per round" + (f" ({partial} still running: not drawn)" if partial else "")
        chart("reward", title, "line", rounds, series, y=_reward_axis(finished))
    if o["statuses"]:
        chart("status", "Episodes by status", "bar", *_by_round(o["statuses"], "status", "n", missing=0), stacked=True)
    if o["turns"]:
        rounds = [r["round"] for r in o["turns"]]
        series = [{"label": k, "data": [r[f"{k}_tokens"] for r in o["turns"]]} for k in ("prompt", "completion")]
        chart("tokens", "Tokens per round", "bar", rounds, series, stacked=True)
    if o["train"]:  # ratios and divergences on one axis; the mismatch check's seconds on their own
        rounds = [r["round"] for r in o["train"]]
        metrics = ["kl", "is_ratio_mean", "clip_fraction", *o["mismatch"]]
        seconds = [m for m in metrics if m.endswith("_seconds")]
        series = [{"label": m, "data": [r.get(m) for r in o["train"]]} for m in metrics if m not in seconds]
        chart("train", "Training per round", "line", rounds, series)
        if seconds:
            series = [{"label": m, "data": [r.get(m) for r in o["train"]]} for m in seconds]
            chart("train-seconds", "Mismatch check seconds per round", "line", rounds, series, y={"min": 0})
    if o["phases"]:
        phases = _by_round(o["phases"], "step", "seconds", order=("collect", "build", "train", "deploy", "eval"))
        chart("phases", "Seconds per loop phase", "bar", *phases, stacked=True)
    return charts


def _reward_axis(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The reward chart's y-axis: 0..1 when every mean lies there (verifiers' usual range), else from 0 (or the
    lowest mean) to the highest, so that one round's value is not drawn on a sliver of an axis."""
    means = [r["mean"] for r in rows if r["mean"] is not None]
    if all(0 <= m <= 1 for m in means):
        return {"min": 0, "max": 1}
    return {"suggestedMin": min(0, *means), "suggestedMax": max(1, *means)}


def _by_round(
    rows: list[dict[str, Any]], column: str, value: str, missing: Any = None, order: tuple[str, ...] | None = None
) -> tuple[list[int], list[dict[str, Any]]]:
    """Rows of (round, column, value) as chart labels (the rounds) and one series per value of `column`, in
    `order` where given (values it lacks are left out), else sorted."""
    rounds = sorted({r["round"] for r in rows})
    present = {r[column] for r in rows}
    names = [n for n in order if n in present] if order else sorted(present)
    by = {(r["round"], r[column]): r[value] for r in rows}
    return rounds, [{"label": n, "data": [by.get((k, n), missing) for k in rounds]} for n in names]
