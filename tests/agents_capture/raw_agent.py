"""A test agent that writes its HTTP requests byte by byte (odd bytes included) through the proxy's CONNECT + TLS.

Usage: raw_agent.py [MODE...]; each MODE is one call to https://api.openai.com (the status line is printed):
  surrogate  a chat body with a lone surrogate escape ("\\ud83d", half an emoji)
  ff_path    a raw 0xFF byte in the path's query
  normal     an ordinary chat call
  secrets    a chat call whose prompt holds every secret in $LCAP_TEST_SECRETS (JSON), and a query that holds two
  hold_store  start a process that holds the store ($LCAP_DB) until the file $LCAP_TEST_RELEASE exists
  kill_writers SECONDS  start a process that SIGKILLs this proxy's turn writers for SECONDS
"""

import base64
import os
import socket
import ssl
import subprocess
import sys
import urllib.parse

proxy = urllib.parse.urlsplit(os.environ["HTTPS_PROXY"])
context = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
auth = base64.b64encode(f"{urllib.parse.unquote(proxy.username or '')}:{proxy.password or ''}".encode()).decode()
NORMAL = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
KILLER = """
import os, signal, sys, time
proxy, until = sys.argv[1], time.monotonic() + float(sys.argv[2])
def alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
while time.monotonic() < until and alive(proxy):
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        if b"lcap.capture.storage.writer" in argv and any(f"/{proxy}-".encode() in a for a in argv):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
    time.sleep(0.005)
"""
HOLDER = """
import duckdb, os, sys, time
con, until = duckdb.connect(sys.argv[1]), time.monotonic() + 120
print("held", flush=True)
while not os.path.exists(sys.argv[2]) and time.monotonic() < until:
    time.sleep(0.02)
"""


def call(body: bytes, path: bytes = b"/v1/chat/completions") -> None:
    sock = socket.create_connection((proxy.hostname, proxy.port), timeout=30)
    sock.sendall(
        b"CONNECT api.openai.com:443 HTTP/1.1\r\nHost: api.openai.com:443\r\n"
        + f"Proxy-Authorization: Basic {auth}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    tls = context.wrap_socket(sock, server_hostname="api.openai.com")
    tls.sendall(
        b"POST " + path + b" HTTP/1.1\r\nHost: api.openai.com\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer sk-test-raw-agent-0123456789abcdef\r\nConnection: close\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    answer = b""
    while chunk := tls.recv(65536):
        answer += chunk
    print(answer.split(b"\r\n", 1)[0].decode(), flush=True)


args = sys.argv[1:]
while args:
    mode = args.pop(0)
    if mode == "surrogate":
        call(b'{"model":"m","messages":[{"role":"user","content":"\\ud83d"}]}')
    elif mode == "ff_path":
        call(NORMAL, b"/v1/chat/completions?x=\xff")
    elif mode == "normal":
        call(NORMAL)
    elif mode == "secrets":
        import json

        secrets = json.loads(os.environ["LCAP_TEST_SECRETS"])
        prompt = "Here is my environment:\n" + "\n".join(f"{kind}: {text}" for kind, text in secrets.items())
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]}).encode()
        query = f"?key={secrets['google']}&trace={secrets['huggingface']}".encode()
        call(body, b"/v1/chat/completions" + query)
    elif mode == "hold_store":
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, os.environ["LCAP_DB"], os.environ["LCAP_TEST_RELEASE"]],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
    elif mode == "kill_writers":
        killer = [sys.executable, "-c", KILLER, str(os.getppid()), args.pop(0)]
        quiet = subprocess.DEVNULL  # not lcap's pipes: the caller waits for them to close
        subprocess.Popen(killer, stdin=quiet, stdout=quiet, stderr=quiet, start_new_session=True)
    else:
        sys.exit(f"unknown mode {mode}")
