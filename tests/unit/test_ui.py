"""`lcap ui`'s app in-process over real DuckDB stores (Starlette's test client); `lcap ui` as a child process:
tests/integration/test_ui.py, in a browser: tests/integration/test_ui_browser.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import duckdb
import pytest
from fixtures_ui import XSS

from lcap.config import LcapError
from lcap.store import Store
from lcap.ui.conversation import conversation, prompt_messages
from lcap.ui.options import UiOptions


@pytest.fixture(scope="session")
def many_db(tmp_path_factory) -> Path:
    """600 episodes of 4 calls (benchmarks/synthetic_store.py, the benchmark's own generator)."""
    from synthetic_store import make_store

    path = tmp_path_factory.mktemp("ui-many") / "many.duckdb"
    make_store(path, turns=2400)
    return path


def client(db: Path, **options):
    from starlette.testclient import TestClient

    from lcap.ui.app import create_app

    return TestClient(create_app(db, UiOptions(**options), token=None), base_url="http://127.0.0.1")


def rows_of(html: str) -> list[str]:
    """The episode ids of the list's rows, in order."""
    body = html.split('<tbody id="rows">', 1)[1].split("</tbody>", 1)[0]
    return re.findall(r'href="/episode\?id=([^"]+)"', body)


def test_prompts_are_read_in_each_dialects_terms():
    chat = prompt_messages(
        "chat",
        {
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "think",
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a": 1}'}}],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "out"},
            ]
        },
    )
    assert [(m.role, [(p.kind, p.text, p.name) for p in m.parts]) for m in chat] == [
        ("system", [("text", "sys", None)]),
        ("user", [("text", "hi", None), ("image", "[image_url]", None)]),
        ("assistant", [("reasoning", "think", None), ("tool_call", '{\n "a": 1\n}', "f")]),
        ("tool", [("tool_result", "out", None)]),
    ]
    responses = prompt_messages(
        "responses",
        {
            "instructions": "be brief",
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
                {"type": "function_call", "name": "w", "call_id": "f1", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "f1", "output": "sunny"},
            ],
        },
    )
    assert [(m.role, m.parts[0].kind, m.parts[0].text) for m in responses] == [
        ("system", "text", "be brief"),
        ("user", "text", "q"),
        ("assistant", "tool_call", "{}"),
        ("tool", "tool_result", "sunny"),
    ]
    messages = prompt_messages(
        "messages",
        {
            "system": "s",
            "messages": [
                {"role": "user", "content": "list"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "ls", "input": {"p": 1}}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "a.txt"}]}
                    ],
                },
            ],
        },
    )
    assert [(m.role, m.parts[0].kind, m.parts[0].text) for m in messages] == [
        ("system", "text", "s"),
        ("user", "text", "list"),
        ("assistant", "tool_call", '{\n "p": 1\n}'),
        ("tool", "tool_result", "a.txt"),
    ]
    assert [(m.role, m.parts[0].text) for m in prompt_messages("completions", {"prompt": "once"})] == [
        ("prompt", "once")
    ]
    assert prompt_messages("chat", "not json")[0].parts[0].kind == "data"  # unreadable: shown as data, no error


def test_each_call_shows_what_it_adds_and_a_rewritten_history_in_full():
    first = {"dialect": "chat", "request": {"messages": [{"role": "user", "content": "q"}]}, "completion_text": "a1"}
    second = {
        "dialect": "chat",
        "request": {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "more"},
            ]
        },
        "completion_text": "a2",
    }
    rewritten = {
        "dialect": "chat",
        "request": {"messages": [{"role": "user", "content": "summary"}]},
        "completion_text": "a3",
    }
    views = conversation([first, second, rewritten])
    assert [[m.parts[0].text for m in v.new] for v in views] == [["q"], ["more"], ["summary"]]
    assert [(v.echoed, v.rewritten) for v in views] == [(0, False), (2, False), (0, True)]
    assert [v.answer.parts[0].text for v in views] == ["a1", "a2", "a3"]


def test_overview_charts_put_each_value_under_its_round():
    from lcap.ui.app import _overview_charts

    o = {
        "rewards": [{"round": 2, "split": "train", "mean": 0.5}, {"round": 1, "split": "eval", "mean": 0.25}],
        "statuses": [{"round": 1, "status": "ok", "n": 3}],
        "turns": [],
        "train": [],
        "mismatch": [],
        "phases": [{"round": 1, "step": "train", "seconds": 9.0}, {"round": 1, "step": "collect", "seconds": 4.0}],
    }
    charts = {c["id"]: c for c in _overview_charts(o)}
    assert charts["reward"]["labels"] == [1, 2]
    assert charts["reward"]["series"] == [
        {"label": "eval", "data": [0.25, None]},
        {"label": "train", "data": [None, 0.5]},
    ]
    assert charts["status"]["series"] == [{"label": "ok", "data": [3]}]
    assert [s["label"] for s in charts["phases"]["series"]] == ["collect", "train"]  # the loop's order
    assert set(charts) == {"reward", "status", "phases"}


def test_overview_charts_leave_out_running_rounds_and_keep_axes_apart():
    """A round whose episodes still run is not plotted (its mean is partial); rewards in [0, 1] get a 0..1 axis;
    the mismatch check's seconds are not drawn on the axis of KL and the IS ratio."""
    from lcap.ui.app import _overview_charts

    o = {
        "rewards": [
            {"round": 0, "split": "eval", "mean": 0.172, "running": 0},
            {"round": 1, "split": "train", "mean": 0.154, "running": 0},
            {"round": 1, "split": "eval", "mean": 0.0, "running": 8},
        ],
        "statuses": [],
        "turns": [],
        "train": [{"round": 1, "kl": 0.01, "is_ratio_mean": 1.0, "clip_fraction": 0.0, "mismatch_seconds": 280.0}],
        "mismatch": ["mismatch_seconds"],
        "phases": [],
    }
    charts = {c["id"]: c for c in _overview_charts(o)}
    reward = charts["reward"]
    assert reward["labels"] == [0, 1]
    assert reward["series"] == [{"label": "eval", "data": [0.172, None]}, {"label": "train", "data": [None, 0.154]}]
    assert "round 1 eval still running" in reward["title"]
    assert reward["y"] == {"min": 0, "max": 1}
    assert [s["label"] for s in charts["train"]["series"]] == ["kl", "is_ratio_mean", "clip_fraction"]
    assert [s["label"] for s in charts["train-seconds"]["series"]] == ["mismatch_seconds"]
    o["rewards"] = [{"round": 1, "split": "train", "mean": 3.5}, {"round": 2, "split": "train", "mean": -1.0}]
    assert _overview_charts(o)[0]["y"] == {"suggestedMin": -1.0, "suggestedMax": 3.5}  # outside [0, 1]: from the data


def test_a_round_whose_episodes_still_run_is_marked_partial(tmp_path):
    """Held-out episodes of round 1 still running: the table says the mean is partial, the chart leaves it out."""
    db = tmp_path / "partial.duckdb"
    store = Store(db)
    for n, status in enumerate(("ok", "running", "running")):
        store.start_episode(f"e{n}", command="agent", cwd="/", labels={"round": "1", "split": "eval", "task": "t"})
        if status == "ok":
            store.end_episode(f"e{n}", status="ok", exit_code=0, error=None)
            store.add_reward(f"e{n}", 0.0, details="{}", source="verifier")
    with client(db) as c:
        page = c.get("/").text
    assert "(partial: 2 running)" in page
    spec = json.loads(page.split('id="chart-reward">', 1)[1].split("</script>", 1)[0])
    assert spec["labels"] == [] and "round 1 eval still running" in spec["title"]


def test_every_page_renders_what_the_store_holds(ui_db):
    with client(ui_db) as c:
        overview = c.get("/")
        assert overview.status_code == 200
        for chart in ("chart-reward", "chart-status", "chart-tokens", "chart-train", "chart-phases"):
            assert f'id="{chart}"' in overview.text
        assert "/runs/demo/round-2/adapter" in overview.text
        # round 3: nothing to learn; round 4: refused by its held-out run; rounds 1 and 2 deployed
        undeployed = overview.text.split("Rounds not deployed", 1)[1].split("</table>", 1)[0]
        assert (
            "<td>3</td><td>skipped: every group got the same reward (2 of 2)</td><td><code>demo-r2</code>" in undeployed
        )
        assert (
            "<td>3</td><td>role solver skipped: no group with a reward spread</td><td><code>demo-solver-r1"
            in undeployed
        )
        assert (
            "<td>4</td><td>refused: held-out reward 0.4 &lt; 0.5 - margin 0</td><td><code>demo-r2</code>" in undeployed
        )
        assert undeployed.count("<tr>") == 4  # the header and three rows
        episode = c.get("/episode", params={"id": "ep-calc-2"})
        assert episode.status_code == 200
        for text in (
            "What is 12 * 7?",
            "The answer is 96.",
            "12 times 7 is 84, the tool agrees.",
            "gpt-4o-mini",
            "verify.py:verify",
            "1/train/calc-1",
            "&#34;expected&#34;: &#34;84&#34;",
        ):
            assert text in episode.text, text
        anthropic = c.get("/episode", params={"id": "ep-anthropic"}).text
        assert "I should call ls." in anthropic and "notes.txt\nplan.md" in anthropic
        responses = c.get("/episode", params={"id": "ep-responses"}).text
        assert "Need the weather tool." in responses and "18 C, sunny" in responses and "Answer briefly." in responses
        group = c.get("/group", params={"round": 1, "split": "train", "task": "calc-1"})
        assert group.status_code == 200
        best, worst = group.text.split("Best vs worst", 1)[1].split("Worst:", 1)
        assert "ep-calc-0" in best and "The answer is 84." in best
        assert "ep-calc-2" in worst and "The answer is 96." in worst
        raw = c.get("/raw", params={"turn": "ep-calc-2/t1", "part": "request"})
        assert raw.headers["content-type"] == "application/json"
        assert json.loads(raw.text)["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "84"}
        assert c.get("/episode", params={"id": "nope"}).status_code == 404
        assert c.get("/raw", params={"turn": "nope"}).status_code == 404
        assert c.get("/raw", params={"turn": "ep-calc-2/t1", "part": "secrets"}).status_code == 400


def test_captured_text_is_escaped_everywhere(ui_db):
    """Agent output, tool names and arguments, model names, task ids, errors, verifier details: never markup."""
    with client(ui_db) as c:
        pages = [
            c.get("/episode", params={"id": "ep-xss"}).text,
            c.get("/episodes").text,
            c.get("/group", params={"round": 1, "split": "train", "task": XSS}).text,
            c.get("/").text,
        ]
    for html in pages:
        assert "<script>window" not in html and "<img src" not in html
    assert "&lt;script&gt;window.__xss = 1&lt;/script&gt;" in pages[0]


def test_the_token_view_shows_the_samples_build_dataset_trains_on(ui_db, tmp_path):
    from lcap.dataset.build.builder import build_dataset
    from lcap.dataset.build.samples_file import read_samples_table

    with client(ui_db) as c:
        html = c.get("/episode", params={"id": "ep-calc-2"}).text
    tokens = html.split('id="tokens"', 1)[1].split('id="group"', 1)[0]
    assert "Decoded with" in tokens and "tokenizer.json" in tokens
    completion = re.findall(r'<span class="tok (lp\d|env)" title="[^"]*?id (\d+)', tokens)
    # The trained sample of this episode, as build-dataset writes it (a copy: the UI's store stays untouched).
    copy = tmp_path / "copy.duckdb"
    copy.write_bytes(ui_db.read_bytes())
    build_dataset(Store(copy), round=1, out=tmp_path / "data")
    sample = next(s for s in read_samples_table(tmp_path / "data").to_pylist() if s["episode_id"] == "ep-calc-2")
    assert [int(i) for _, i in completion] == sample["completion_ids"]
    assert [0 if kind == "env" else 1 for kind, _ in completion] == sample["env_mask"]
    assert tokens.count('class="boundary"') == 2  # two calls merged into one sample
    first = re.search(r'<span class="tok (lp\d)"[^>]*>([^<]*)</span>', tokens.split("call 2", 1)[1])
    assert first and first.group(1) == "lp4" and first.group(2) == "The"  # logprob -3.0: the least likely shade


def test_without_a_tokenizer_the_token_view_shows_ids(ui_db, tmp_path):
    copy = tmp_path / "ui.duckdb"
    copy.write_bytes(ui_db.read_bytes())
    with client(copy, tokenizer=str(tmp_path / "missing")) as c:
        tokens = c.get("/episode", params={"id": "ep-calc-2"}).text.split('id="tokens"', 1)[1]
    assert "no tokenizer.json at" in tokens and "showing token ids" in tokens


def test_episode_list_filters(ui_db):
    with client(ui_db) as c:

        def ids(**query) -> list[str]:
            answer = c.get("/episodes", params=query)
            assert answer.status_code == 200, answer.text
            return sorted(rows_of(answer.text))

        assert ids(flag="tampered") == ["ep-completions"]
        assert ids(flag="verifier_error") == ["ep-xss"]
        assert ids(flag="truncated") == ["ep-completions"]
        assert ids(flag="failed_call") == ["ep-xss"]
        assert ids(flag="no_reward") == ["ep-running"]
        assert ids(flag="rebuilt") == ["ep-anthropic", "ep-responses", "ep-xss"]
        assert ids(round=2) == ["ep-r2-0", "ep-r2-1", "ep-r2-2"]
        assert ids(split="eval") == ["ep-eval-0", "ep-eval-1"]
        assert ids(status="running") == ["ep-running"]
        assert ids(task="calc-1", round=1) == ["ep-calc-0", "ep-calc-1", "ep-calc-2", "ep-calc-3", "ep-running"]
        assert ids(q="EVAL") == ["ep-eval-0", "ep-eval-1"]
        assert ids(reward_min=0.4, reward_max=0.6, round=1) == ["ep-calc-3", "ep-eval-0"]
        by_reward = rows_of(
            c.get(
                "/episodes", params={"sort": "reward", "order": "asc", "round": 1, "split": "train", "task": "calc-1"}
            ).text
        )
        assert by_reward == ["ep-calc-2", "ep-calc-3", "ep-calc-0", "ep-calc-1", "ep-running"]  # NULLs last


def test_episode_list_pages_and_sorts_server_side(many_db):
    with client(many_db) as c:
        first = c.get("/episodes", params={"per_page": 25})
        assert "600 episodes match · page 1 of 24" in first.text
        assert first.headers["server-timing"].startswith("db;dur=")
        pages = [rows_of(c.get("/episodes", params={"per_page": 25, "page": n}).text) for n in range(1, 25)]
        assert all(len(p) == 25 for p in pages)
        assert len({e for p in pages for e in p}) == 600  # every episode once, none twice
        last = c.get("/episodes", params={"per_page": 100, "page": 6, "sort": "episode"}).text
        assert rows_of(last)[-1] == "ep99" and 'rel="next"' not in last and 'rel="prev"' in last
        beyond = c.get("/episodes", params={"per_page": 100, "page": 9}).text
        assert rows_of(beyond) == [] and "600 episodes match · page 9 of 6" in beyond
        desc = rows_of(c.get("/episodes", params={"sort": "episode", "order": "desc"}).text)
        assert desc[:3] == ["ep99", "ep98", "ep97"]


def test_bad_query_values_are_named_and_ignored(ui_db):
    with client(ui_db) as c:
        answer = c.get(
            "/episodes",
            params={
                "round": "two",
                "sort": "reward; DROP TABLE turns",
                "per_page": 7,
                "reward_min": "nan",
                "flag": "made_up",
            },
        )
    assert answer.status_code == 400
    for said in (
        "round: &#39;two&#39; is not a number",
        "sort: unknown value",
        "per_page: use one of",
        "reward_min: &#39;nan&#39; is not a finite number",
        "flag: unknown value",
    ):
        assert said in answer.text, said
    assert len(rows_of(answer.text)) == 14  # the page still lists, unfiltered


def test_columns_a_newer_lcap_adds_are_shown_when_present(ui_db, tmp_path):
    """The UI reads the columns a store has: a store from before stitching and the mismatch guard still shows."""
    newer = tmp_path / "newer.duckdb"
    newer.write_bytes(ui_db.read_bytes())
    store = Store(newer)
    store.execute("UPDATE turns SET stitched = true, role = 'planner' WHERE episode_id = 'ep-r2-1'")
    store.execute("UPDATE train_runs SET mismatch_kl = 0.0123, mismatch = '[]', step_kl = 0.0456")
    older = tmp_path / "older.duckdb"
    older.write_bytes(ui_db.read_bytes())
    con = duckdb.connect(str(older))  # Store would migrate it back to today's columns
    con.execute("ALTER TABLE turns DROP COLUMN stitched")
    con.execute("ALTER TABLE turns DROP COLUMN role")
    for column in ("mismatch_kl", "mismatch_logp_diff", "mismatch_seconds", "mismatch", "mismatch_held", "step_kl"):
        con.execute(f"ALTER TABLE train_runs DROP COLUMN {column}")
    con.close()
    with client(newer) as c:
        assert "0.0123" in c.get("/").text and ">mismatch_kl<" in c.get("/").text
        assert "0.0456" in c.get("/").text and ">step_kl<" in c.get("/").text
        assert ">mismatch<" not in c.get("/").text and ">mismatch_held<" not in c.get("/").text  # not figures
        assert rows_of(c.get("/episodes", params={"flag": "stitched"}).text) == ["ep-r2-1"]
        assert 'badge flag-soft">stitched' in c.get("/episode", params={"id": "ep-r2-1"}).text
        assert ">role: planner</span>" in c.get("/episode", params={"id": "ep-r2-1"}).text
    with client(older) as c:  # the older store: no such filter, no such column
        assert "stitched" not in c.get("/episodes").text and "mismatch" not in c.get("/").text
        episode = c.get("/episode", params={"id": "ep-r2-1"})
        assert episode.status_code == 200 and "role:" not in episode.text


def test_security_headers_and_host_check(ui_db):
    with client(ui_db) as c:
        page = c.get("/episodes")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["x-content-type-options"] == "nosniff"
        assert page.headers["cache-control"] == "no-store"
        # Loopback: another Host name (DNS rebinding) is refused.
        assert c.get("/episodes", headers={"host": "attacker.example"}).status_code == 400
        assert c.get("/static/vendor/chart.umd.min.js").status_code == 200


def test_a_store_from_an_older_lcap_gets_an_error_page_not_a_crash(tmp_path):
    db = tmp_path / "old.duckdb"
    Store(db).execute("DROP TABLE loop_steps")
    with client(db) as c:
        answer = c.get("/")
    assert answer.status_code == 500 and "the store could not answer this page" in answer.text
    assert "loop_steps" in answer.text


def test_a_groups_advantages_are_the_ones_build_dataset_uses(ui_db, tmp_path):
    """The group page narrows `episode_advantages` to one group; both must agree on every episode, a
    re-run of a sample (the latest counts) and a failed one included."""
    from fixtures_ui import UiStore, make_tokenizer

    from lcap.ui import queries

    db = tmp_path / "groups.duckdb"
    db.write_bytes(ui_db.read_bytes())
    b = UiStore(Store(db), make_tokenizer(tmp_path / "tok"))
    b.clock = 10_000
    b.episode("ep-calc-1-rerun", b.calc_turns(), sample=1, reward=0.0)
    b.episode("ep-calc-failed", b.calc_turns(), sample=5, reward=1.0, status="failed")
    with Store(db).connect(read_only=True) as con:
        view = {
            e: (a, z)
            for e, a, z in con.execute("SELECT episode_id, advantage, zero_variance FROM episode_advantages").fetchall()
        }
        groups = con.execute("SELECT DISTINCT round, coalesce(split, 'train'), task_id FROM episodes").fetchall()
        mine = {
            m["episode_id"]: (m["advantage"], m["zero_variance"])
            for r, s, t in groups
            for m in queries.group(con, r, s, t)
            if m["advantage"] is not None
        }
    assert "ep-calc-1" not in mine and "ep-calc-1-rerun" in mine and "ep-calc-failed" not in mine
    assert mine.keys() == view.keys()
    for episode, (advantage, zero) in view.items():
        assert mine[episode][0] == pytest.approx(advantage) and mine[episode][1] == zero, episode


def test_the_live_stream_says_when_it_ends_as_planned(ui_db):
    """A stream closes after `--stream-seconds` and the browser reconnects: its last event says so (`end`), so the
    page does not show `live: reconnecting` for a planned close (ui/static/app.js; in a browser:
    tests/integration/test_ui_browser.py)."""
    with client(ui_db, poll=0.2, stream_seconds=1) as c, c.stream("GET", "/events") as answer:
        events = [line for line in answer.iter_lines() if line.startswith("event: ")]
    assert events[0] == "event: change" and events[-1] == "event: end"
    for bad in (0.5, 3601):
        with pytest.raises(LcapError, match=f"--stream-seconds {bad}: use 1 to 3600 seconds"):
            UiOptions(stream_seconds=bad)
