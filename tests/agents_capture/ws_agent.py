"""A test agent: the Responses API over a WebSocket (as some coding CLIs speak it), default host.

`websockets` (>= 15) reads HTTPS_PROXY and the CA from the environment, like an unmodified CLI.
"""

import json
import os

from websockets.sync.client import connect

with connect(
    "wss://api.openai.com/v1/responses", additional_headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
) as ws:
    ws.send(json.dumps({"type": "response.create", "generate": False, "model": "gpt-5", "input": "warm up"}))
    for prompt in ("Say hello", "Say it again"):
        ws.send(json.dumps({"type": "response.create", "model": "gpt-5", "input": prompt}))
        text = []
        while True:
            event = json.loads(ws.recv(timeout=30))
            if event["type"] == "response.output_text.delta":
                text.append(event["delta"])
            if event["type"] == "response.completed":
                break
        print("ws:", "".join(text), flush=True)
