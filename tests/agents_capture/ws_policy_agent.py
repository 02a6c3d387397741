"""A test agent: a three-call Responses conversation over a WebSocket (as Codex CLI speaks it), default host.

The second call resends the first call's output and adds a user message, as a harness does; the third names
the second's response by previous_response_id and sends only a new message, as Codex does. LOGIT_BIAS
(JSON) is passed as is. Prints each event type it gets, so a test can check that nothing of lcap's arrives.
"""

import json
import os

from websockets.sync.client import connect

bias = json.loads(os.environ.get("LOGIT_BIAS", "{}"))
items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is x?"}]}]
with connect(
    "wss://api.openai.com/v1/responses", additional_headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
) as ws:
    ws.send(json.dumps({"type": "response.create", "generate": False, "model": "gpt-5", "input": []}))
    while (event := json.loads(ws.recv(timeout=300)))["type"] not in ("response.completed", "error"):
        pass  # the warm-up's answer comes before the first call is sent, as Codex does
    print("event:", event["type"], flush=True)
    for _ in range(2):
        request = {"model": "gpt-5", "instructions": "Be brief.", "input": items, "max_output_tokens": 32}
        ws.send(json.dumps({"type": "response.create", **request, "store": False, "logit_bias": bias}))
        while True:
            event = json.loads(ws.recv(timeout=300))
            print("event:", event["type"], flush=True)
            if event["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
                break
        if event["type"] != "response.completed":
            continue
        items = [*items, *event["response"]["output"]]
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And y?"}]})
    # then as Codex continues: the previous response by id, and only what is new
    more = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And z?"}]}]
    request = {"model": "gpt-5", "instructions": "Be brief.", "input": more, "max_output_tokens": 32}
    ws.send(json.dumps({"type": "response.create", **request, "previous_response_id": event["response"]["id"]}))
    while True:
        event = json.loads(ws.recv(timeout=300))
        print("event:", event["type"], flush=True)
        if event["type"] in ("response.completed", "response.incomplete", "response.failed", "error"):
            break
