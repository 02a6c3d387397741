"""How each round's policy of a `lcap demo --task tools` run opens an episode, read exactly instead of sampled.

    .venv/bin/python benchmarks/demo_first_call.py OUT [OUT ...]

The first call's prompt is the same in every episode (the agent's system prompt, tools and the question), so its
choice is a distribution this script can read: the warm-started model (OUT/model), alone and with each round's
adapter (OUT/run/round-N/adapter, which continues the round before), scores the first prompt teacher-forced.
Prints per round the probability that the first call is a lookup (the tokens up to the query, written as the
warm start writes them), its least sure token and, given one, the probability of each query's first token
("words" finds the task's words; the others find nothing).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.logging import disable_progress_bar

    from lcap.loop.demo.tools import KEY, QUESTION, WRONG_QUERIES, agent_module, lookup_call

    disable_progress_bar()
    agent = agent_module()
    for out in map(Path, sys.argv[1:]):
        tokenizer = AutoTokenizer.from_pretrained(out / "model")
        messages = [{"role": "system", "content": agent.SYSTEM}, {"role": "user", "content": QUESTION}]
        prompt = str(
            tokenizer.apply_chat_template(messages, tools=agent.TOOLS, add_generation_prompt=True, tokenize=False)
        )
        opening = lookup_call(KEY).split(KEY)[0]  # up to the query

        def ids(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        prompt_ids, call_ids = ids(prompt), ids(prompt + opening)
        assert call_ids[: len(prompt_ids)] == prompt_ids, "the opening changes how the prompt tokenises"
        queries = {q: ids(prompt + opening + q)[len(call_ids)] for q in (KEY, *WRONG_QUERIES)}
        base = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32)
        rounds = sorted(int(p.parent.name.split("-")[1]) for p in (out / "run").glob("round-*/adapter"))
        print(out)
        for n in [0, *rounds]:
            model = base if n == 0 else PeftModel.from_pretrained(base, out / "run" / f"round-{n}" / "adapter")
            model.eval()
            with torch.no_grad():
                logp = model(torch.tensor([call_ids])).logits[0].log_softmax(-1)
            tokens = [logp[i - 1, call_ids[i]].item() for i in range(len(prompt_ids), len(call_ids))]
            weakest = min(range(len(tokens)), key=tokens.__getitem__)
            after = logp[len(call_ids) - 1].exp()
            shares = ", ".join(f"{q} {after[i].item():.3f}" for q, i in queries.items())
            print(
                f"  round {n}: a lookup call {torch.tensor(sum(tokens)).exp().item():.3f} (least sure of its "
                f"{len(tokens)} tokens: {tokenizer.decode(call_ids[len(prompt_ids) + weakest])!r} "
                f"{torch.tensor(tokens[weakest]).exp().item():.3f}); its query: {shares}"
            )
            if n:
                base = model.unload()


if __name__ == "__main__":
    main()
