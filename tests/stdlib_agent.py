"""The source of an agent's chat call that needs no SDK, for the agents the loop and collect tests write and start by
the hundred: importing the OpenAI SDK costs a process more CPU than the rest of a tiny-model episode together
(docs/benchmarks.md, "The test suite's time"). It sends what the SDK sends (the same URL, headers and JSON, the same two retries)
through the proxy lcap gives the agent (HTTPS_PROXY, its CA in SSL_CERT_FILE). What the SDKs themselves send and get
through lcap is tested where that is the point (tests/integration/test_capture_agents.py, test_serve_proxy.py,
test_real_model.py's bundled agents, the harness matrix)."""


def chat_agent(source: str) -> str:
    """An agent's source: `source`, which calls `chat(messages, **params)` as it would the SDK's create()."""
    return CHAT + source


CHAT = '''
import json as _json, os as _os, time as _time, urllib.error as _error, urllib.request as _request


def chat(messages, *, model="gpt-4o-mini", headers=None, **params):
    """One chat completion, as `OpenAI().chat.completions.create(...)` makes it: the reply's content ("" if none)."""
    base = _os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
    body = _json.dumps({"model": model, "messages": messages, **params}).encode()
    head = {"content-type": "application/json", "authorization": "Bearer " + _os.environ.get("OPENAI_API_KEY", "")}
    for attempt in range(3):  # the SDK's default: two retries, on a connection error, 408, 409, 429 and 5xx
        request = _request.Request(base.rstrip("/") + "/chat/completions", body, {**head, **(headers or {})})
        try:
            with _request.urlopen(request, timeout=600) as response:
                return _json.load(response)["choices"][0]["message"]["content"] or ""
        except _error.HTTPError as exc:
            if attempt == 2 or not (exc.code in (408, 409, 429) or exc.code >= 500):
                raise
        except _error.URLError:
            if attempt == 2:
                raise
        _time.sleep(0.5 * 2**attempt)
'''
