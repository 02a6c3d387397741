"""A test agent: the anthropic SDK, default host (api.anthropic.com). Usage: anthropic_agent.py stream|plain|tools"""

import sys

import anthropic

client = anthropic.Anthropic(max_retries=0, timeout=30)
MESSAGES = [{"role": "user", "content": "Say hello"}]

for mode in sys.argv[1:]:
    if mode == "stream":
        with client.messages.stream(model="claude-sonnet-4-5", max_tokens=64, messages=MESSAGES) as stream:
            text = "".join(stream.text_stream)
        print("stream:", text, flush=True)
    elif mode == "plain":
        r = client.messages.create(model="claude-sonnet-4-5", max_tokens=64, messages=MESSAGES)
        print("plain:", r.content[0].text, flush=True)
    elif mode == "tools":
        tools = [
            {
                "name": "get_weather",
                "description": "Weather",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            }
        ]
        with client.messages.stream(model="claude-sonnet-4-5", max_tokens=64, messages=MESSAGES, tools=tools) as stream:
            final = stream.get_final_message()
        block = final.content[0]
        print("tool:", block.name, block.input, flush=True)
