"""A multi-turn tool-using agent (openai SDK, chat completions with tools), as a user would write it.

The model gets a `lookup` tool (a few facts, or the `--facts` given). The harness runs the tool calls
the model makes; when the model answers in plain text instead, the harness looks the question up
itself and sends the result as an observation (a ReAct-style loop), for `--turns` calls.
`--compact-at N` rewrites the history before call N (earlier observations replaced by a summary), as
harnesses that compact their context do. It calls https://api.openai.com with OPENAI_API_KEY and knows nothing of lcap.
"""

import argparse
import json
import os

from openai import OpenAI

SYSTEM = "Use the lookup tool, then answer."
FACTS = {"capital of france": "Paris", "boiling point of water": "100 C", "largest planet": "Jupiter"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a fact up in the encyclopedia.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    }
]


def lookup(query: str, facts: dict[str, str] = FACTS) -> str:
    query = query.lower()
    return next((v for k, v in facts.items() if k in query or query in k), "no entry") + f" (for {query!r})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--question", required=True)
    ap.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"))
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the API's)")
    ap.add_argument("--compact-at", type=int, default=None)
    ap.add_argument("--logit-bias", default=None, help="JSON {token_id: bias}, passed to the API as is")
    ap.add_argument("--facts", default=None, help="JSON {key: fact}: the encyclopedia `lookup` reads instead")
    args = ap.parse_args()

    client = OpenAI()
    facts = json.loads(args.facts) if args.facts else FACTS
    extra = {"logit_bias": json.loads(args.logit_bias)} if args.logit_bias else {}
    if args.temperature is not None:
        extra["temperature"] = args.temperature
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": args.question}]
    answer = ""
    for call in range(args.turns):
        if args.compact_at is not None and call == args.compact_at:
            messages = messages[:2] + [
                {"role": "user", "content": f"Summary of {call} earlier steps: looked up facts."}
            ]
        response = client.chat.completions.create(
            model=args.model, messages=messages, tools=TOOLS, max_tokens=args.max_tokens, **extra
        )
        message = response.choices[0].message
        answer = message.content or ""
        assistant = {"role": "assistant", "content": answer}
        if message.tool_calls:
            assistant["tool_calls"] = [c.model_dump() for c in message.tool_calls]
        messages.append(assistant)
        if message.tool_calls:
            for tool_call in message.tool_calls:
                try:
                    query = json.loads(tool_call.function.arguments or "{}").get("query", "")
                except json.JSONDecodeError:
                    query = ""
                messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": lookup(query, facts)})
        else:
            messages.append({"role": "user", "content": f"Observation {call}: {lookup(args.question, facts)}"})
    print(answer)


if __name__ == "__main__":
    main()
