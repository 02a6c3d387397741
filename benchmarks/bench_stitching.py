"""Stitching's proof on the bundled multi-turn tool agent: samples per episode and trained tokens, stitched or not.

    .venv/bin/python benchmarks/bench_stitching.py [--episodes 4] [--turns 3 6] [--repeats 10]

For each chat template, the tiny model (`lcap init-model`) is served by `lcap serve` (vLLM with lcap's
endpoints) and scripts/agents/openai_tools.py (openai SDK, a `lookup` tool, real tool results between its
calls) runs `--episodes` episodes of each `--turns` through lcap's proxy (`--upstream policy`), once with
stitching (the default) and once with `--no-stitch` (every prompt rendered from the messages: lcap before
stitching). Templates:

    own      the tiny model's template (serve/tiny_model.py)
    qwen3    a Qwen3-style variant: the generation prompt opens and closes an empty <think> block and
             earlier assistant messages are rendered without their reasoning (as Qwen3 does), so a
             re-rendered history never starts with what the model was given

The agent's answers end on the stop token through `logit_bias` (a random model rarely samples it; a trained
one does). Per case, from the store through build-dataset's merge (lcap.dataset.build.merge): calls stitched,
merge rate (calls merged into their predecessor's sample / calls after each episode's first), samples per
episode, and trained tokens per episode (the tokens of its samples: what one training pass reads).
Then the added latency: one call (max_tokens 1) repeated `--repeats` times on the last conversation, through
vLLM's own /v1/chat/completions (today's path without lcap's endpoints), lcap's endpoint without a head
(rendered), and lcap's endpoint with the previous turn's head (stitched); median milliseconds each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "scripts" / "agents" / "openai_tools.py"
QUESTIONS = ["capital of france", "largest planet", "boiling point of water", "capital of spain"]


def qwen3_template() -> str:
    from lcap.serve.tiny_model import CHAT_TEMPLATE

    history = "render_content(message.content).split('</think>')[-1].lstrip('\\n')"
    plain = "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}"
    template = CHAT_TEMPLATE.replace(
        "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant'"
        " and not message.tool_calls) %}\n" + plain,
        "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\n"
        + plain
        + "\n{%- elif message.role == 'assistant' and not message.tool_calls %}\n"
        + "{{- '<|im_start|>assistant\\n' + "
        + history
        + " + '<|im_end|>\\n' }}",
    )
    template = template.replace(
        "{%- if message.content %}{{- '\\n' + render_content(message.content) }}{%- endif %}",
        "{%- if message.content %}{{- '\\n' + " + history + " }}{%- endif %}",
    )
    template = template.replace(
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    )
    assert template.count(history) == 2 and "<think>" in template, "serve/tiny_model.py's template changed"
    return template


def episode_stats(db: Path) -> list[dict]:
    """Per episode: calls, stitched calls, samples and trained tokens under build-dataset's merge."""
    import duckdb

    from lcap.dataset.build.merge import merge_turns

    con = duckdb.connect(str(db), read_only=True)
    try:
        table = con.sql(
            "SELECT episode_id, episode_id AS group_id, seq, thread, deployment, rebuilt, truncated,"
            " prompt_ids::INTEGER[] AS prompt_ids, completion_ids::INTEGER[] AS completion_ids,"
            " list_transform(completion_ids, lambda x: 0.0)::FLOAT[] AS logprobs"
            " FROM turn_tokens WHERE prompt_ids IS NOT NULL AND completion_ids IS NOT NULL"
        ).to_arrow_table()
        calls = dict(
            con.sql(
                "SELECT episode_id, (count(*), count(*) FILTER (WHERE stitched), count(*) FILTER (WHERE status_code"
                " <> 200), count(*) FILTER (WHERE cut_by_token_limit(finish_reason))"
                " - CASE WHEN arg_max(cut_by_token_limit(finish_reason), seq) THEN 1 ELSE 0 END, avg(latency_ms))"
                " FROM turns GROUP BY episode_id"
            ).fetchall()
        )
    finally:
        con.close()
    samples = merge_turns(table).to_pylist()
    out = []
    for episode, value in calls.items():
        n, stitched, failed, cut, latency = value.values() if isinstance(value, dict) else value
        mine = [s for s in samples if s["episode_id"] == episode]
        tokens = sum(len(s["prompt_ids"]) + len(s["completion_ids"]) for s in mine)
        out.append(
            {
                "calls": n,
                "stitched": stitched,
                "failed": failed,
                "cut": cut,  # calls before the last cut by the token limit: each ends its sample, stitched or not
                "samples": len(mine),
                "tokens": tokens,
                "ms": latency,
            }
        )
    return out


def run_agents(db: Path, stitch: bool, turns: int, episodes: int, bias: str) -> None:
    from lcap.capture.options import ProxyOptions
    from lcap.capture.proxy.server import CaptureProxy
    from lcap.store import Store

    with CaptureProxy(Store(db), ProxyOptions(upstream="policy", stitch=stitch)) as proxy:
        for i in range(episodes):
            env = {**os.environ, **proxy.child_env(f"t{turns}-e{i}"), "OPENAI_API_KEY": "bench-placeholder"}
            question = QUESTIONS[i % len(QUESTIONS)]
            cmd = [sys.executable, str(AGENT), "--question", question, "--model", "gpt-4o", "--turns", str(turns)]
            subprocess.run([*cmd, "--max-tokens", "16", "--logit-bias", bias], env=env, check=True, timeout=900)


def added_latency(url: str, model: str, db: Path, repeats: int, bias: dict) -> dict[str, float]:
    """Median ms of one max_tokens=1 call on the last stored conversation, three ways (see the module's doc)."""
    import duckdb
    import httpx

    con = duckdb.connect(str(db), read_only=True)
    try:
        ((request,),) = con.sql("SELECT request FROM turns WHERE stitched ORDER BY started_at DESC LIMIT 1").fetchall()
    finally:
        con.close()
    body = {**json.loads(request), "model": model, "max_tokens": 1, "logit_bias": bias}
    body.pop("stream", None)
    client = httpx.Client(base_url=url, timeout=300)
    # the head of the conversation up to its last assistant message: the previous call of the same conversation
    cut = max(i for i, m in enumerate(body["messages"]) if m["role"] == "assistant")
    for seed in range(20):  # an answer that ends on its stop token (one cut by max_tokens leaves no head)
        earlier = {**body, "messages": body["messages"][:cut], "max_tokens": 64, "seed": seed}
        answer, _, head = client.post("/lcap/v1/chat/completions", json=earlier).content.split(b"\n", 2)
        if head != b"null":
            break
    said = json.loads(answer)["choices"][0]["message"]
    messages = [*body["messages"][:cut], {"role": "assistant", "content": said.get("content") or ""}]
    body["messages"] = messages + body["messages"][cut + 1 :]
    ways = {
        "vllm /v1/chat/completions": ("/v1/chat/completions", {**body, "return_token_ids": True, "logprobs": True}),
        "lcap endpoint, rendered": ("/lcap/v1/chat/completions", {**body, "lcap": {"head": None}}),
        "lcap endpoint, stitched": ("/lcap/v1/chat/completions", {**body, "lcap": {"head": json.loads(head)}}),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, (path, payload) in ways.items():
            start = time.perf_counter()
            resp = client.post(path, json=payload)
            times[name].append((time.perf_counter() - start) * 1000)
            assert resp.status_code == 200, resp.text[:300]
            if "stitched" in name:
                record = json.loads(resp.content.split(b"\n")[1])
                assert record["stitched"], record
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=4, help="Episodes per case.")
    parser.add_argument("--turns", type=int, nargs="+", default=[3, 6], help="Calls per episode (one case each).")
    parser.add_argument("--repeats", type=int, default=10, help="Calls per way in the latency measure.")
    parser.add_argument("--templates", nargs="+", default=["own", "qwen3"], choices=["own", "qwen3"])
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from lcap.serve.server import start_server, stop_server
    from lcap.serve.tiny_model import init_model
    from lcap.serve.vllm_process import resolve_python

    python = resolve_python()  # lcap's vLLM venv, found before LCAP_HOME points at the benchmark's own home
    work = Path(tempfile.mkdtemp(prefix="bench-stitching-"))
    os.environ["LCAP_HOME"] = str(work / "home")
    os.environ["LCAP_POLICY_RECORD"] = str(work / "home" / "policy.json")
    rows = []
    latencies = {}
    for template in args.templates:
        model = init_model(work / f"tiny-{template}")
        if template == "qwen3":
            (model / "chat_template.jinja").write_text(qwen3_template())
        stop = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("<|im_end|>")
        bias = {str(stop): 6}
        record = start_server(str(model), python=python, served_name="tiny", timeout=900)
        try:
            assert record.lcap_endpoints, "vLLM did not load lcap's endpoints"
            for turns in args.turns:
                for stitch in (False, True):
                    db = work / f"{template}-{turns}-{'on' if stitch else 'off'}.duckdb"
                    run_agents(db, stitch, turns, args.episodes, json.dumps(bias))
                    stats = episode_stats(db)
                    multi = [s for s in stats if s["calls"] > 1 and not s["failed"]]
                    whole = [s for s in multi if not s["cut"]]
                    after_first = sum(s["calls"] - 1 for s in multi)
                    merged = sum(s["calls"] - s["samples"] for s in multi)
                    rows.append(
                        {
                            "template": template,
                            "turns": turns,
                            "stitch": "on" if stitch else "off",
                            "episodes": len(multi),
                            "stitched": f"{sum(s['stitched'] for s in multi)}/{after_first}",
                            "merge rate": f"{merged / max(after_first, 1):.0%}",
                            "one sample": f"{sum(s['samples'] == 1 for s in multi)}/{len(multi)}",
                            "one sample, no call cut": f"{sum(s['samples'] == 1 for s in whole)}/{len(whole)}",
                            "samples/ep": statistics.mean(s["samples"] for s in multi),
                            "trained tokens/ep": statistics.mean(s["tokens"] for s in multi),
                            "ms/call": statistics.mean(s["ms"] for s in multi),
                        }
                    )
                    print(rows[-1], flush=True)
            latencies[template] = added_latency(record.url, record.served_model, db, args.repeats, bias)
            print(template, latencies[template], flush=True)
        finally:
            stop_server()

    print(f"\n{args.episodes} episodes per case, agent {AGENT.relative_to(ROOT)}, tiny model on vLLM (CPU)\n")
    names = list(rows[0])
    print("| " + " | ".join(names) + " |")
    print("|" + "---|" * len(names))
    for row in rows:
        cells = [f"{v:.2f}" if isinstance(v, float) else str(v) for v in row.values()]
        print("| " + " | ".join(cells) + " |")
    print(f"\nadded latency: one call, max_tokens 1, median of {args.repeats} (ms)\n")
    ways = list(next(iter(latencies.values())))
    print("| template | " + " | ".join(ways) + " |")
    print("|---|" + "---|" * len(ways))
    for template, values in latencies.items():
        print(f"| {template} | " + " | ".join(f"{values[w]:.0f}" for w in ways) + " |")


if __name__ == "__main__":
    main()
