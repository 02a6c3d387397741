"""Every route on a real pretrained model: SmolLM2-135M-Instruct (`lcap init-model --from smollm2`) on vLLM CPU.

One converted checkpoint (cached across sessions, `smollm2_dir`) and one `lcap serve` for the module
(`smollm2_server`). The tiny random model lets pass what a real BPE tokenizer and template can break: merges
across the template's joins, a tool call spelled in several tokens, the assistant's answer rendered again. The
tests assert what lcap guarantees (exact ids, logprobs, stitching, stored rows), never the
model's wording; the one steer is asking the model to repeat a tool call, which it does. Answers are greedy and
short: decode on this model runs at about ten tokens a second here.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
from fixtures_capture import turns
from fixtures_vllm import make_lora, perturbed_checkpoint
from policy_agents import Agents, episode_samples, extends_previous, policy_proxy, sdk_clients

from lcap.capture.options import ProxyOptions
from lcap.capture.proxy.server import CaptureProxy
from lcap.config import LcapError
from lcap.policy import read_policy
from lcap.store import Store
from lcap.train.grpo import train_round
from lcap.train.options import MISMATCH_MAX, TrainOptions

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a fact up.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }
]
ECHO = "Repeat the user's message exactly."


def tool_call_text(query: str) -> str:
    """A tool call as the template (and vLLM's hermes parser) writes it: the model repeats it when asked to."""
    return f'<tool_call>\n{{"name": "lookup", "arguments": {{"query": "{query}"}}}}\n</tool_call>'


def check_tokens(row: dict, served: str) -> None:
    assert row["status_code"] == 200, row["error"]
    assert row["token_source"] == "vllm" and row["deployment"] == served, row["dialect"]
    ids, logprobs = row["completion_token_ids"], row["completion_logprobs"]
    assert len(ids) > 0 and len(logprobs) == len(ids), row["dialect"]
    assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs), row["dialect"]


def test_every_dialect_exact_ids_and_logprobs(smollm2_policy, tmp_path, capture_home):
    """Chat completions, completions, Responses and Messages, each plain and streamed, through the proxy: the
    stored prompt ids are vLLM's own rendering of the request, the completion ids decode to the text the agent
    got, every sampled token has a finite logprob, and a streamed answer has the plain one's ids (greedy)."""
    server = smollm2_policy
    db = tmp_path / "lcap.duckdb"
    question = [{"role": "user", "content": "Name one colour."}]
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
        oa, an = sdk_clients(proxy, "dialects")
        chat = dict(model="gpt-4o", messages=question, max_tokens=6, temperature=0)
        plain = oa.chat.completions.create(**chat)
        streamed = "".join(
            c.choices[0].delta.content or "" for c in oa.chat.completions.create(**chat, stream=True) if c.choices
        )
        text = dict(model="gpt-3.5-turbo-instruct", prompt="The capital of France is", max_tokens=6, temperature=0)
        oa.completions.create(**text)
        list(oa.completions.create(**text, stream=True))
        responses = dict(model="gpt-5", input="Name one colour.", max_output_tokens=6, temperature=0)
        oa.responses.create(**responses)
        list(oa.responses.create(**responses, stream=True))
        messages = dict(model="claude-sonnet-4-5", messages=question, max_tokens=6, temperature=0)
        an.messages.create(**messages)
        with an.messages.stream(**messages) as stream:
            final = stream.get_final_message()
    assert plain.choices[0].message.content == streamed
    assert final.usage.output_tokens > 0

    rows = turns(db)
    assert [(r["dialect"], r["stream"]) for r in rows] == [
        (dialect, stream) for dialect in ("chat", "completions", "responses", "messages") for stream in (False, True)
    ]
    vllm = httpx.Client(base_url=server.url, timeout=60)
    chat_prompt = vllm.post(
        "/tokenize", json={"model": server.served_model, "messages": question, "add_generation_prompt": True}
    ).json()["tokens"]
    text_prompt = vllm.post("/tokenize", json={"model": server.served_model, "prompt": text["prompt"]}).json()["tokens"]
    for row in rows:
        check_tokens(row, server.served_model)
        if row["dialect"] in ("chat", "messages", "responses"):
            assert row["prompt_token_ids"] == chat_prompt, row["dialect"]
        else:
            assert row["prompt_token_ids"] == text_prompt
        if row["finish_reason"] == "length" and row["dialect"] in ("chat", "completions"):
            decoded = vllm.post(
                "/detokenize", json={"model": server.served_model, "tokens": row["completion_token_ids"]}
            ).json()["prompt"]
            assert decoded == row["completion_text"], row["dialect"]
    for plain_row, stream_row in zip(rows[::2], rows[1::2]):
        assert plain_row["completion_token_ids"] == stream_row["completion_token_ids"], plain_row["dialect"]
        assert plain_row["completion_logprobs"] == pytest.approx(stream_row["completion_logprobs"], abs=1e-4)


def test_tool_call_parsed_streamed_and_stitched(smollm2_policy, tmp_path, capture_home):
    """The model writes a tool call (asked to repeat one): vLLM's hermes parser finds it in SmolLM2's tokens,
    plain and streamed ('<tool_call>' is five tokens here, not one added token); the agent sends it back with the
    tool's result, and that call is stitched onto the model's exact ids, its prompt rendered by the template's tool
    sections. Then a four-call tool agent: every call after one that ended on a stop token merges."""
    server = smollm2_policy
    db = tmp_path / "lcap.duckdb"
    messages: list = [{"role": "system", "content": ECHO}, {"role": "user", "content": tool_call_text("france")}]
    with CaptureProxy(Store(db), ProxyOptions(upstream="policy")) as proxy:
        oa, _ = sdk_clients(proxy, "tool-ep")
        common = dict(model="gpt-4o", tools=TOOLS, max_tokens=40, temperature=0)
        answer = oa.chat.completions.create(messages=messages, **common)
        chunks = list(oa.chat.completions.create(messages=messages, stream=True, **common))
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == "tool_calls", message
        (call,) = message.tool_calls
        assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"query": "france"}
        streamed = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
        assert streamed[0].function.name == "lookup"
        assert json.loads("".join(d.function.arguments or "" for d in streamed)) == {"query": "france"}
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()

        # the harness's history: the call as it got it, the tool's answer, then the user again (three more calls)
        for turn, query in enumerate(("germany", "spain", "italy")):
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content,
                    "tool_calls": [c.model_dump() for c in message.tool_calls or ()],
                }
            )
            if message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": f"Fact {turn}."})
            messages.append({"role": "user", "content": tool_call_text(query)})
            answer = oa.chat.completions.create(messages=messages, **common)
            message = answer.choices[0].message

    rows = turns(db)
    assert len(rows) == 5
    for row in rows:
        check_tokens(row, server.served_model)
    calls = [[(c["name"], json.loads(c["arguments"])) for c in r["tool_calls"]] for r in rows[:2]]
    assert calls == [[("lookup", {"query": "france"})]] * 2
    assert rows[0]["completion_token_ids"] == rows[1]["completion_token_ids"]
    tokenizer_text = httpx.post(
        f"{server.url}/detokenize",
        json={"model": server.served_model, "tokens": rows[2]["prompt_token_ids"]},
        timeout=60,
    ).json()["prompt"]
    assert "<tools>" in tokenizer_text and "<tool_response>\nFact 0.\n</tool_response>" in tokenizer_text

    agent = [rows[0], *rows[2:]]  # the streamed repeat of the first call is another thread of the episode
    ended = [r["finish_reason"] in ("stop", "tool_calls") for r in agent]
    assert ended[0]
    assert [r["stitched"] for r in agent] == [False, *ended[:-1]], [r["stitch_note"] for r in agent]
    assert all(extends_previous([a, b]) == [True] for a, b in itertools.pairwise(agent) if b["stitched"])
    merged = sum(r["stitched"] for r in agent[1:])
    print(
        f"\nSmolLM2 echo tool agent: {merged} of {len(agent) - 1} follow-up calls merged; finish {[r['finish_reason'] for r in agent]}"
    )


def test_bundled_tool_agent_merge_rate(smollm2_policy, tmp_path, capture_home):
    """scripts/agents/openai_tools.py through `lcap proxy` on the real model, greedy: each call after one that
    ended on a stop token is stitched onto it, and the episode is as many samples as build-dataset's merge makes
    of calls cut by the token limit. The merge rate is printed (a figure for the benchmarks, not a bound)."""
    db = tmp_path / "lcap.duckdb"
    agent = [sys.executable, str(ROOT / "scripts/agents/openai_tools.py"), "--question", "capital of france"]
    agent += ["--model", "gpt-4o", "--turns", "4", "--max-tokens", "24", "--temperature", "0"]
    done = subprocess.run(
        [str(Path(sys.executable).parent / "lcap"), "proxy", "--db", str(db), "--upstream", "policy", "--", *agent],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OPENAI_API_KEY": "sk-test"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = turns(db)
    assert len(rows) == 4
    for row in rows:
        check_tokens(row, smollm2_policy.served_model)
    ended = [r["finish_reason"] in ("stop", "tool_calls") for r in rows]
    assert [r["stitched"] for r in rows] == [False, *ended[:-1]], [r["stitch_note"] for r in rows]
    assert all(extends_previous([a, b]) == [True] for a, b in itertools.pairwise(rows) if b["stitched"])
    (samples,) = episode_samples(db).values()
    assert samples == 1 + ended[:-1].count(False)
    print(
        f"\nSmolLM2 bundled tool agent: {len(rows) - samples} of {len(rows) - 1} follow-up calls merged;"
        f" finish {[r['finish_reason'] for r in rows]}"
    )


# The demo's verifier (scripts/demo/verify.py) plus a step per sample index: every group has variance, so GRPO
# trains whatever the model answers. The stored reward is checked against this sum.
STEPPED_VERIFIER = """
import sys
sys.path.insert(0, {demo!r})
from verify import score

def verify(ctx):
    scored = score(str(ctx.task["answer"]), ctx.stdout)
    return {{**scored, "reward": scored["reward"] + 0.1 * ctx.sample}}
"""


def scored_logprobs(server, model: str, row: dict) -> list[float]:
    """vLLM's logprobs under `model` of a stored call's completion tokens after its prompt (prompt_logprobs)."""
    prompt, completion = row["prompt_token_ids"], row["completion_token_ids"]
    body = {"model": model, "prompt": prompt + completion, "max_tokens": 1, "prompt_logprobs": 0}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300).json()
    per_token = answer["choices"][0]["prompt_logprobs"][len(prompt) :]
    return [position[str(t)]["logprob"] for position, t in zip(per_token, completion, strict=True)]


@pytest.fixture(scope="module")
def calculator_round(smollm2_server, tmp_path_factory):
    """`lcap loop --async` (run_loop with overlap) on the demo's calculator task and bundled agent, SmolLM2: two
    steps of 1 training task x 2 episodes (each step's training is most of this file's time). --max-staleness 0:
    step 2's episodes wait for step 1's deploy, so every one of them is served by step 1's adapter. No held-out run:
    under load, decoding beside training costs minutes."""
    from lcap.dataset.options import BuildOptions, CollectOptions
    from lcap.loop.demo import calculator
    from lcap.loop.demo.number import write_jsonl
    from lcap.loop.demo.task import demo_dir
    from lcap.loop.options import LoopOptions
    from lcap.loop.rounds import run_loop
    from lcap.loop.steps import LoopConfig
    from lcap.train.options import TrainOptions

    smollm2_server.use_base()
    out = tmp_path_factory.mktemp("calculator")
    train, _ = calculator.make_tasks([], n_train=2, n_eval=0, seed=0)
    (out / "verify.py").write_text(STEPPED_VERIFIER.format(demo=str(demo_dir())))
    config = LoopConfig(
        run=out / "run",
        rounds=2,
        tasks=write_jsonl(out / "tasks.jsonl", train),
        command=calculator.agent_command(),
        tasks_per_round=1,
        collect=CollectOptions(group_size=2, concurrency=4, timeout=300, verifier=f"{out / 'verify.py'}:verify"),
        build=BuildOptions(truncated="keep"),
        train=TrainOptions(base_model=str(smollm2_server.model_dir), learning_rate=1e-3, report_to="none"),
        options=LoopOptions(overlap=True, max_staleness=0),
    )
    saved = os.environ.get("OPENAI_API_KEY")
    os.environ["OPENAI_API_KEY"] = "sk-test"
    lines: list[str] = []
    try:
        summaries = run_loop(Store(out / "lcap.duckdb"), config, echo=lines.append)
    finally:
        if saved is None:
            os.environ.pop("OPENAI_API_KEY", None)
        else:
            os.environ["OPENAI_API_KEY"] = saved
    assert [s.round for s in summaries] == [1, 2], lines
    yield out, json.loads((out / "run" / "state.json").read_text())["steps"], lines
    smollm2_server.use_base()


def test_one_async_calculator_round_end_to_end(smollm2_server, calculator_round):
    """What lcap guarantees of a real-model loop, whatever the model says: every call has its prompt and completion
    ids and a logprob per completion token; the dataset's loss mask covers exactly the tokens the model sampled
    (tool results and the template's joins between merged calls are masked out) with the served logprobs beside
    them; a reward is stored for every episode and the samples carry it; each step's adapter is hot-loaded into
    the same vLLM process and names the calls served after it (step 2's episodes), whose logprobs vLLM gives
    again under the adapter's name and not under the base's."""
    out, steps, lines = calculator_round
    store = Store(out / "lcap.duckdb")
    rows = turns(out / "lcap.duckdb")
    episodes = {
        e: (split, n, reward, sample)
        for e, split, n, reward, sample in store.fetchall(
            "SELECT episode_id, split, round, reward, sample FROM episode_summary"
        )
    }
    assert sorted((s, n) for s, n, _, _ in episodes.values()) == [("train", 1)] * 2 + [("train", 2)] * 2
    assert {r["episode_id"] for r in rows} == set(episodes)
    for row in rows:
        check_tokens(row, row["deployment"])
        assert len(row["prompt_token_ids"]) > 0

    # rewards: one per episode, the demo's score (0, 0.5 or 1) plus the sample's step
    for episode, (_, _, reward, sample) in episodes.items():
        assert reward is not None
        assert round(reward - 0.1 * sample, 6) in (0.0, 0.5, 1.0), (episode, reward)

    # the adapters: hot-loaded (no restart), each naming the calls that followed its deploy
    deployed = {n: steps[f"{n}:deploy"]["name"] for n in (1, 2)}
    assert read_policy().pid == smollm2_server.record.pid
    lora = store.fetchall("SELECT name, round FROM deployments WHERE kind = 'lora' ORDER BY round")
    assert lora == [(deployed[1], 1), (deployed[2], 2)]
    by_episode: dict[str, list[dict]] = {}
    for row in rows:
        by_episode.setdefault(row["episode_id"], []).append(row)
    served = {(episodes[e][0], episodes[e][1]): {r["deployment"] for r in rs} for e, rs in by_episode.items()}
    assert served[("train", 1)] == {smollm2_server.served_model} and served[("train", 2)] == {deployed[1]}

    # the adapter's scores of a call it served are its own, not the base's, on the same ids
    call = next(r for r in rows if r["deployment"] == deployed[1])
    scored = {m: scored_logprobs(smollm2_server, m, call) for m in (deployed[1], smollm2_server.served_model)}
    base_shift = max(abs(a - b) for a, b in zip(scored[smollm2_server.served_model], call["completion_logprobs"]))
    assert max(abs(a - b) for a, b in zip(scored[deployed[1]], call["completion_logprobs"])) < 1e-3 < base_shift

    # the dataset each step trained on: masks over exactly the sampled tokens, the served logprobs, the reward
    for n in (1, 2):
        samples = pq.read_table(out / "run" / f"round-{n}" / "data" / "samples.parquet").to_pylist()
        assert {s["episode_id"] for s in samples} == {
            e for e, (s, k, _, _) in episodes.items() if (s, k) == ("train", n)
        }
        for episode in {s["episode_id"] for s in samples}:
            mine = [s for s in samples if s["episode_id"] == episode]
            sampled = [
                (t, lp)
                for s in mine
                for t, lp, m in zip(s["completion_ids"], s["logprobs"], s["env_mask"], strict=True)
                if m
            ]
            calls = by_episode[episode]
            assert [t for t, _ in sampled] == [t for r in calls for t in r["completion_token_ids"]]
            assert [lp for _, lp in sampled] == pytest.approx([lp for r in calls for lp in r["completion_logprobs"]])
            assert mine[0]["prompt_ids"] == calls[0]["prompt_token_ids"]
            assert [s["reward"] for s in mine] == pytest.approx([episodes[episode][2]] * len(mine))
            assert {s["deployment"] for s in mine} == {smollm2_server.served_model if n == 1 else deployed[1]}

    follow_ups = [(a, b) for rs in by_episode.values() for a, b in itertools.pairwise(rs)]
    could = [b for a, b in follow_ups if a["finish_reason"] in ("stop", "tool_calls")]
    assert all(b["stitched"] for b in could), [b["stitch_note"] for b in could]
    print(
        f"\nSmolLM2 calculator round: {sum(b['stitched'] for _, b in follow_ups)} of {len(could)} follow-up calls "
        f"that could merge merged ({len(follow_ups)} follow-ups); {len(rows)} calls; "
        f"rewards {sorted(round(r, 2) for _, _, r, _ in episodes.values())}; " + "; ".join(lines)
    )


def test_mismatch_guard_on_served_lora_samples(smollm2_server, calculator_round, tmp_path):
    """Step 2 trained on episodes served by step 1's adapter, continuing that adapter: the guard (lcap train's own,
    in train_round) measured KL ~ 0 and passed. The same samples, trained from another adapter as if it were the
    one deployed: the guard stops the round before any step."""
    out, steps, _ = calculator_round
    (kl, diff, held, details) = Store(out / "lcap.duckdb").fetchall(
        "SELECT mismatch_kl, mismatch_logp_diff, mismatch_held, mismatch FROM train_runs WHERE round = 2"
    )[0]
    (measured,) = json.loads(details)
    assert held == measured["deployment"] == steps["1:deploy"]["name"] and measured["samples"] == 2
    assert measured["tokens"] > 0 and 0 <= kl < MISMATCH_MAX / 100 and diff < 0.05

    wrong = tmp_path / "wrong"
    make_lora(smollm2_server.model_dir, wrong / "round-1" / "adapter", seed=2, scale=0.05)
    data = out / "run" / "round-2" / "data" / "samples.parquet"
    options = TrainOptions(base_model=str(smollm2_server.model_dir), report_to="none")
    with pytest.raises(LcapError, match="adapter being trained is not the one vLLM served") as stopped:
        train_round(Store(tmp_path / "lcap.duckdb"), wrong, 2, options, data=data)
    assert f"deployment '{steps['1:deploy']['name']}'" in str(stopped.value)
    assert not (wrong / "round-2" / "adapter").exists()
    (wrong_kl,) = [d["kl"] for d in json.loads((wrong / "round-2" / "mismatch.json").read_text())["deployments"]]
    print(f"\nSmolLM2 mismatch KL: right adapter {kl:.3g}, wrong adapter {wrong_kl:.3g}")
    assert wrong_kl > MISMATCH_MAX


def test_full_checkpoint_reloads_in_place_on_smollm2(smollm2_policy, tmp_path):
    """A full checkpoint of SmolLM2 (other weights, the same config) deployed while agents call through the proxy,
    streamed and not: vLLM reloads it in place (the same process), no call fails, the calls after the deploy name
    it, and vLLM now scores the tokens the checkpoint served as it served them, and the base's tokens otherwise.
    The base's weights are deployed back after."""
    from lcap.serve.deploy import deploy_policy

    before = read_policy()
    base = smollm2_policy.served_model
    checkpoint = perturbed_checkpoint(smollm2_policy.model_dir, tmp_path / "round-1" / "checkpoint", scale=0.01)
    db = tmp_path / "lcap.duckdb"
    try:
        with policy_proxy(tmp_path) as proxy, Agents(proxy, threads=2, stream_every=2, max_tokens=8) as agents:
            agents.wait_for(2)
            name = deploy_policy(checkpoint, name="smollm2-r1", round=1, store=Store(db), drain_timeout=300)
            deployed_at = time.time()
            agents.wait_after(time.monotonic(), n=2)
        after = read_policy()
        assert after.pid == before.pid and after.current == name and after.served_name(name) == base
        assert after.base_model == str(checkpoint.resolve())
        failed = [c for c in agents.calls if not c["ok"]]
        assert not failed, failed[:3]
        rows = turns(db)
        for row in rows:
            check_tokens(row, row["deployment"])
        assert {r["deployment"] for r in rows} == {base, name} and {r["model_served"] for r in rows} == {base}
        assert all(r["deployment"] == name for r in rows if r["started_at"].timestamp() > deployed_at)
        served = {label: next(r for r in rows if r["deployment"] == label) for label in (base, name)}
        shift = {
            label: max(
                abs(a - b) for a, b in zip(scored_logprobs(smollm2_policy, base, row), row["completion_logprobs"])
            )
            for label, row in served.items()
        }
        assert shift[name] < 1e-3 < shift[base], shift
    finally:  # the tests that follow expect SmolLM2's own weights
        deploy_policy(smollm2_policy.model_dir, name=base)
    assert read_policy().pid == before.pid and read_policy().base_model == str(smollm2_policy.model_dir.resolve())
