"""A test agent: the openai Python SDK, default host (api.openai.com), env-configured only.

Usage: openai_agent.py MODE [MODE...]; prints what the model said, one line per call.
"""

import os
import sys
import time

from openai import OpenAI

client = OpenAI(max_retries=0, timeout=30)
MESSAGES = [{"role": "user", "content": "Say hello. My key is sk-user-pasted-secret-abcdef0123456789"}]
WEATHER = {"name": "get_weather", "description": "Weather in a city"}
TOOLS = [
    {
        "type": "function",
        "function": {**WEATHER, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    }
]


def run(mode: str) -> None:
    if mode == "chat":
        r = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
        print("chat:", r.choices[0].message.content, flush=True)
    elif mode == "chat_stream":
        stream = client.chat.completions.create(
            model="gpt-4o-mini", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
        parts = []
        for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    parts.append(choice.delta.content)
                    print("delta:", choice.delta.content, flush=True)
        print("chat_stream:", "".join(parts), flush=True)
    elif mode == "tools":
        r = client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, tools=TOOLS)
        call = r.choices[0].message.tool_calls[0]
        print("tool:", call.function.name, call.function.arguments, flush=True)
    elif mode == "tools_stream":
        name, args = None, ""
        for chunk in client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES, tools=TOOLS, stream=True):
            for choice in chunk.choices:
                for tc in choice.delta.tool_calls or ():
                    name = tc.function.name or name
                    args += tc.function.arguments or ""
        print("tool:", name, args, flush=True)
    elif mode == "completions":
        r = client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Say hello")
        print("completions:", r.choices[0].text, flush=True)
    elif mode == "responses":
        r = client.responses.create(model="gpt-4.1-mini", input="Say hello")
        print("responses:", r.output_text, flush=True)
    elif mode == "responses_stream":
        parts = []
        with client.responses.stream(model="gpt-4.1-mini", input="Say hello") as stream:
            for event in stream:
                if event.type == "response.output_text.delta":
                    parts.append(event.delta)
        print("responses_stream:", "".join(parts), flush=True)
    elif mode == "models":  # side traffic on the same host: must pass through, not be stored
        try:
            client.models.list()
        except Exception as exc:
            print("models failed:", type(exc).__name__, flush=True)
    elif mode == "error":
        try:
            client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
        except Exception as exc:
            print("error:", getattr(exc, "status_code", None), flush=True)
    elif mode == "crash":
        sys.stdout.flush()
        os._exit(3)
    elif mode == "wait":
        print("READY", flush=True)
        time.sleep(60)
    else:
        raise SystemExit(f"unknown mode {mode}")


for mode in sys.argv[1:]:
    run(mode)
