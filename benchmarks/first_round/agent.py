"""A fresh agent for the walk: the openai SDK, one tool (`letters`: a word's letters, counted), a final answer."""

import json
import sys

from openai import OpenAI

client = OpenAI()  # OPENAI_BASE_URL / proxy settings come from the environment
word = sys.argv[1]
tools = [
    {
        "type": "function",
        "function": {
            "name": "letters",
            "description": "Count the letters of a word.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
        },
    }
]
messages = [
    {"role": "system", "content": "You answer with a number only. Use the letters tool when it helps."},
    {"role": "user", "content": f"How many letters does the word '{word}' have?"},
]
for _ in range(3):
    reply = client.chat.completions.create(
        model="policy", messages=messages, tools=tools, max_tokens=48, temperature=1.0
    )
    msg = reply.choices[0].message
    if not msg.tool_calls:
        print(msg.content or "")
        break
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls:
        try:
            arg = json.loads(call.function.arguments).get("word", "")
        except json.JSONDecodeError:
            arg = ""
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(len(arg))})
