"""The demo's learning, in one process and in minutes: for choosing the demo's tasks and settings.

    .venv/bin/python benchmarks/demo_sweep.py [--task number|tools] [--seed 0] [--rounds 5] [--set NAME=VALUE ...]
                                              [--truncated keep] [--eval-samples 4] [--fixed-tasks]

`lcap demo` spends its time running agents (a process each) through the proxy. This script keeps
everything else and drops that: the same tiny model, warm start, tasks, verifier and GRPO round
(`train_round`) as `lcap demo --task TASK` with the task's `DemoSettings` (override any with
`--set lr=2e-3`), but completions are sampled in-process with transformers' `generate` (temperature 1,
the agent's token limit) instead of by vLLM behind the proxy. For the tools task the sweep plays the agent
(scripts/agents/openai_tools.py: its tools, `lookup` and observations; tool calls parsed as `<tool_call>` JSON,
as vLLM's hermes parser does) and stitches each call onto the previous one's ids, as the policy route does; an
episode's calls make one sample (environment tokens masked), a call cut by the token limit starts a new one.
A group's advantage and the dataset's cleaning follow build-dataset: equal-reward groups are left out,
samples cut by the token limit are kept or dropped (`--truncated`). Held-out questions are sampled
`--eval-samples` times each (the demo: once), so the curve is less noisy than the demo's. `--fixed-tasks`
trains on the same questions every round instead of new ones.

Prints, per round: held-out mean reward, well-formed, right and cut-off shares (tools: also how often an
episode's lookup found the words), and the round's training figures. Not a check of `lcap demo` itself:
`scripts/demo/check_learning.py` reads a real run's store.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=("number", "tools"), default="number")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], help="A DemoSettings field, NAME=VALUE.")
    parser.add_argument("--truncated", choices=("keep", "drop"), default="keep")
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--fixed-tasks", action="store_true")
    parser.add_argument("--centred", action="store_true", help="Advantage r - group mean (no division by the std).")
    parser.add_argument("--model", type=Path, help="Reuse this warm-started model (made and kept there if absent).")
    args = parser.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.logging import disable_progress_bar

    from lcap.dataset.build.samples_file import SAMPLE_SCHEMA
    from lcap.loop.demo.runner import MODEL, demo_task
    from lcap.loop.demo.task import DemoSettings
    from lcap.serve.tiny_model import init_model
    from lcap.store import Store
    from lcap.train.grpo import train_round
    from lcap.train.options import TrainOptions

    sys.path.insert(0, str(ROOT / "scripts" / "demo"))
    from verify import score

    disable_progress_bar()
    torch.set_num_threads(1)
    kind = demo_task(args.task)
    fields = {f.name: f.type for f in dataclasses.fields(DemoSettings)}
    overrides = {}
    for item in args.set:
        name, _, value = item.partition("=")
        overrides[name] = (int if fields[name] in ("int", int) else float)(value)
    settings = dataclasses.replace(kind.settings(args.seed), **overrides)
    print(f"task {kind.name}; settings: {settings}; truncated {args.truncated}; fixed tasks {args.fixed_tasks}")

    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="lcap-demo-sweep-"))
    model_dir = args.model or work / "model"
    if not (model_dir / "config.json").exists():
        init_model(model_dir, dataclasses.replace(MODEL, seed=settings.seed))
        report = kind.warm_start(model_dir, settings)
        print(f"warm start: {time.perf_counter() - t0:.0f} s, final loss {report['loss']:.3f}", flush=True)
    train_tasks, held_out = kind.tasks(settings)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    options = TrainOptions(
        base_model=str(model_dir),
        learning_rate=settings.lr,
        epochs=settings.epochs,
        epsilon_high=settings.epsilon_high,
        batch_size=settings.batch_size,
        report_to="none",
        seed=settings.seed,
        current="sweep",
    )

    def policy(adapter: Path | None):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        return model.eval()

    def generate(model, prompts: list[list[int]], max_new: int) -> list[tuple[list[int], list[float], bool]]:
        """One completion per prompt at temperature 1: (ids up to and with the stop token, their logprobs, cut by
        the limit). Equal prompts are sampled as one batch."""
        out: list[tuple[list[int], list[float], bool] | None] = [None] * len(prompts)
        same: dict[tuple[int, ...], list[int]] = {}
        for i, ids in enumerate(prompts):
            same.setdefault(tuple(ids), []).append(i)
        for ids, where in same.items():
            batch = torch.tensor([list(ids)] * len(where))
            with torch.no_grad():
                gen = model.generate(
                    batch,
                    attention_mask=torch.ones_like(batch),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=max_new,
                    eos_token_id=eos,
                    pad_token_id=tokenizer.pad_token_id,
                    return_dict_in_generate=True,
                    output_scores=True,
                )
                logps = model.compute_transition_scores(gen.sequences, gen.scores, normalize_logits=True)
            for k, i in enumerate(where):
                completion = gen.sequences[k, len(ids) :].tolist()
                cut = eos not in completion
                length = len(completion) if cut else completion.index(eos) + 1
                out[i] = (completion[:length], logps[k, :length].tolist(), cut)
        return [o for o in out if o is not None]

    def segment(prompt: list[int]) -> dict:
        return dict(prompt_ids=prompt, completion_ids=[], logprobs=[], env_mask=[], truncated=False)

    def number_episodes(model, tasks: list[dict], n: int) -> list[dict]:
        """n episodes per task of scripts/demo/agent.py: one call, the question as the user message, 8 tokens."""
        episodes = []
        prompts = []
        for task in tasks:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": task["question"]}], add_generation_prompt=True, tokenize=False
            )
            prompts += [tokenizer(prompt, add_special_tokens=False)["input_ids"]] * n
        for i, (completion, logprobs, cut) in enumerate(generate(model, prompts, 8)):
            task = tasks[i // n]
            text = tokenizer.decode(completion, skip_special_tokens=True)
            seg = dict(segment(prompts[i]), completion_ids=completion, logprobs=logprobs, truncated=cut)
            seg["env_mask"] = [1] * len(completion)
            episodes.append(dict(task=task, segments=[seg], cut=cut, **score(task["answer"], text)))
        return episodes

    def tools_episodes(model, tasks: list[dict], n: int) -> list[dict]:
        """n episodes per task of scripts/agents/openai_tools.py, call by call; each call's prompt is the previous
        call's ids + its completion + the new messages rendered (the policy route's stitching) unless that call was
        cut by the token limit: then the rendered history starts a new sample."""
        from lcap.loop.demo.tools import MAX_TOKENS, TURNS, agent_module

        agent = agent_module()

        def render(messages: list[dict], prompt: bool = True) -> str:
            return str(
                tokenizer.apply_chat_template(messages, tools=agent.TOOLS, add_generation_prompt=prompt, tokenize=False)
            )

        def encode(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        runs = []
        for task in tasks:
            for _ in range(n):
                messages = [{"role": "system", "content": agent.SYSTEM}, {"role": "user", "content": task["question"]}]
                runs.append(
                    dict(task=task, messages=messages, segments=[segment(encode(render(messages)))], said="", found=0)
                )
        for call in range(TURNS):
            prompts = [r["segments"][-1]["prompt_ids"] + r["segments"][-1]["completion_ids"] for r in runs]
            for r, (completion, logprobs, cut) in zip(runs, generate(model, prompts, MAX_TOKENS)):
                seg = r["segments"][-1]
                seg["completion_ids"] += completion
                seg["logprobs"] += logprobs
                seg["env_mask"] += [1] * len(completion)
                seg["truncated"] = cut
                text = tokenizer.decode(completion, skip_special_tokens=True)
                calls = []
                for block in TOOL_CALL.findall(text):
                    try:
                        parsed = json.loads(block)
                        if isinstance(parsed["name"], str) and isinstance(parsed.get("arguments", {}), dict):
                            calls.append((parsed["name"], json.dumps(parsed.get("arguments", {}))))
                    except (ValueError, KeyError, TypeError):
                        pass  # not a call the parser would pass on
                content = text[: text.find("<tool_call>")].strip() if calls else text
                r["said"] = content
                messages = r["messages"]
                assistant: dict = {"role": "assistant", "content": content}
                if calls:
                    assistant["tool_calls"] = [
                        {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": arguments}}
                        for k, (name, arguments) in enumerate(calls)
                    ]
                before = render(messages + [assistant], prompt=False)
                messages.append(assistant)
                for k, (_, arguments) in enumerate(calls):
                    try:
                        query = json.loads(arguments).get("query", "")
                    except (ValueError, AttributeError):
                        query = ""
                    result = agent.lookup(str(query), r["task"]["facts"])
                    r["found"] |= not result.startswith("no entry")
                    messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": result})
                if not calls:
                    observation = agent.lookup(r["task"]["question"], r["task"]["facts"])
                    messages.append({"role": "user", "content": f"Observation {call}: {observation}"})
                if call == TURNS - 1:
                    continue
                after = render(messages)
                if cut or not after.startswith(before):
                    r["segments"].append(segment(encode(after)))
                else:
                    new = encode(after[len(before) - 1 :])  # from the newline after the answer's stop token
                    seg["completion_ids"] += new
                    seg["logprobs"] += [0.0] * len(new)
                    seg["env_mask"] += [0] * len(new)
        return [
            dict(
                task=r["task"],
                segments=r["segments"],
                cut=any(s["truncated"] for s in r["segments"]),
                turns=len(r["segments"]),
                found=r["found"],
                **score(r["task"]["answer"], r["said"]),
            )
            for r in runs
        ]

    episodes = number_episodes if kind.name == "number" else tools_episodes

    def sample(model, tasks: list[dict], n: int, seed: int) -> list[dict]:
        torch.manual_seed(seed)
        return episodes(model, tasks, n)

    def shares(rows: list[dict]) -> str:
        n = len(rows)
        samples = sum(len(r["segments"]) for r in rows) / n
        return (
            f"reward {sum(r['reward'] for r in rows) / n:.3f} (well-formed {sum(r['well_formed'] for r in rows) / n:.2f},"
            f" right {sum(r['right'] for r in rows) / n:.2f}, cut off {sum(r['cut'] for r in rows) / n:.2f}"
            + (
                f", looked the words up {sum(r['found'] for r in rows) / n:.2f}, samples/episode {samples:.2f})"
                if kind.name == "tools"
                else ")"
            )
        )

    store = Store(work / "lcap.duckdb")
    adapter = None
    k, g = settings.tasks_per_round, settings.group_size
    for n in range(args.rounds + 1):
        model = policy(adapter)
        line = f"round {n}: held-out {shares(sample(model, held_out, args.eval_samples, seed=10_000 + n))}"
        if n == args.rounds:
            print(f"{line} | {time.perf_counter() - t0:.0f} s", flush=True)
            break
        tasks = (
            train_tasks[:k]
            if args.fixed_tasks
            else [train_tasks[i % len(train_tasks)] for i in range(n * k, n * k + k)]
        )
        rows = sample(model, tasks, g, seed=n)
        samples = []
        for t in range(len(tasks)):
            group = rows[t * g : (t + 1) * g]
            rewards = [r["reward"] for r in group]
            if max(rewards) == min(rewards):
                continue  # no GRPO signal: build-dataset leaves equal-reward groups out
            mean = sum(rewards) / g
            std = (sum((x - mean) ** 2 for x in rewards) / (g - 1)) ** 0.5
            for i, r in enumerate(group):
                for j, seg in enumerate(r["segments"]):
                    if not seg["completion_ids"] or (seg["truncated"] and args.truncated == "drop"):
                        continue
                    samples.append(
                        dict(
                            seg,
                            sample_id=f"{n}-{t}-{i}-{j}",
                            episode_id=f"{n}-{t}-{i}",
                            task_id=r["task"]["id"],
                            round=n + 1,
                            group_id=f"{n + 1}/train/{r['task']['id']}",
                            reward=r["reward"],
                            advantage=(r["reward"] - mean) / (1.0 if args.centred else std + 1e-4),
                            deployment="sweep",
                            rebuilt=False,
                            n_turns=sum(
                                seg["env_mask"][m] == 0 and seg["env_mask"][m - 1] == 1
                                for m in range(1, len(seg["env_mask"]))
                            )
                            + 1,
                            merged=len(r["segments"]) == 1 and kind.name == "tools",
                        )
                    )
        if samples:  # else no group told its samples apart: nothing to train on this round
            data = work / "run" / f"round-{n + 1}" / "data"
            data.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(samples, schema=SAMPLE_SCHEMA), data / "samples.parquet")
            adapter = train_round(store, work / "run", n + 1, options, data=data).output
        print(
            f"{line} | training: {shares(rows)}, {len(samples)} samples trained | {time.perf_counter() - t0:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
