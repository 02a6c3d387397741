"""What lcap's proxy and these endpoints exchange besides the dialect itself.

The proxy side is lcap.capture.routing.policy_wire; tests/unit/test_stitching.py checks that both say the same.

A request to PREFIX + the dialect's path (`/lcap/v1/chat/completions`, `/lcap/v1/messages`,
`/lcap/v1/responses`, the last also as a WebSocket) is the agent's own request plus one member,
REQUEST_KEY: `{"adapt": bool, "stitch": bool, "head": HEAD}`. The answer is the dialect's answer,
byte for byte what the agent gets, plus two parts the proxy takes out: the turn's record (small JSON:
stitched or why not, what was adapted, the behaviour logprobs) and the head (the turn's exact ids and
what the next turn of the same conversation must match to be stitched onto them). The proxy keeps the
head as bytes and sends it back, unread, with the conversation's next request.

- a whole answer: ANSWER "\\n" RECORD "\\n" HEAD (each compact JSON, so the first two newlines cut it)
- a stream (SSE): the dialect's events, then `event: lcap` (RECORD) and `event: lcap-head` (HEAD)
- a WebSocket: the dialect's frames, then {"type": "lcap", ...RECORD} and {"type": "lcap-head", "head": HEAD}
"""

PREFIX = "/lcap"
REQUEST_KEY = "lcap"
RECORD_EVENT = "lcap"
HEAD_EVENT = "lcap-head"
INFO_PATH = "/lcap/v1/info"  # GET: {"version", "max_model_len", "dialects"}: the proxy's check that the endpoints exist
VERSION = 1
