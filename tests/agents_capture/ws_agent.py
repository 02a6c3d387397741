"""A test agent: the Responses API over a WebSocket (as some coding CLIs speak it), default host.

`websockets` (>= 15) reads HTTPS_PROXY and the CA from the environment, like an unmodified CLI. With WS_ROLE set,
its opening sends `X-Lcap-Role: $WS_ROLE`.
"""

import json
import os

from websockets.sync.client import connect

headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
if os.environ.get("WS_ROLE"):
    headers["X-Lcap-Role"] = os.environ["WS_ROLE"]
with connect("wss://api.openai.com/v1/responses", additional_headers=headers) as ws:
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
