"""A test agent whose clients ignore proxy settings, as many do: only `--transparent` captures them.

Usage: proxyless_agent.py MODE...; each MODE is one chat call to api.openai.com (its answer is printed):
  aiohttp         aiohttp.ClientSession() as it comes (trust_env=False: no proxy, ever)
  aiohttp_stream  the same, streamed (each SSE event printed as it arrives, flushed)
  requests        a requests Session with trust_env = False (certifi's CA bundle, no proxy)
  raw             a socket and ssl.create_default_context(), the request written by hand
  urllib          urllib.request with ssl.create_default_context() (the system's CA paths, or SSL_CERT_FILE)
  http            plain HTTP on port 80, by hand
  loopback        GET $LOCAL_URL/v1/models, a service on the host's loopback (printed, not an LLM call)
  banner HOST:PORT  read what a server that speaks first sends (SSH, SMTP: passed through as it is)
  udp             send a UDP datagram off the machine (QUIC): refused inside the namespace
  whoami          print this process's network namespace (an inode) and pid, then sleep until killed
"""

import asyncio
import json
import os
import socket
import ssl
import sys
import time
import urllib.request

URL = "https://api.openai.com/v1/chat/completions"
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
HEADERS = {"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY', 'sk-none')}"}


def content(answer: dict) -> str:
    return answer["choices"][0]["message"]["content"]


async def with_aiohttp(stream: bool) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        body = {**BODY, "stream": True} if stream else BODY
        async with session.post(URL, json=body, headers=HEADERS) as resp:
            if not stream:
                print("aiohttp:", content(await resp.json()), flush=True)
                return
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                    if delta:
                        print("aiohttp_stream:", delta.strip(), flush=True)


def with_requests() -> None:
    import requests

    session = requests.Session()
    session.trust_env = False  # no proxy variables and no REQUESTS_CA_BUNDLE: certifi's bundle, directly
    print("requests:", content(session.post(URL, json=BODY, headers=HEADERS, timeout=30).json()), flush=True)


def by_hand(port: int) -> None:
    body = json.dumps(BODY).encode()
    sock = socket.create_connection(("api.openai.com", port), timeout=30)
    if port == 443:
        sock = ssl.create_default_context().wrap_socket(sock, server_hostname="api.openai.com")
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: api.openai.com\r\nContent-Type: application/json\r\n"
        f"Authorization: {HEADERS['Authorization']}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    print("raw:" if port == 443 else "http:", content(json.loads(data.split(b"\r\n\r\n", 1)[1])), flush=True)


def main(modes: list[str]) -> None:
    while modes:
        mode = modes.pop(0)
        if mode in ("aiohttp", "aiohttp_stream"):
            asyncio.run(with_aiohttp(mode == "aiohttp_stream"))
        elif mode == "requests":
            with_requests()
        elif mode in ("raw", "http"):
            by_hand(443 if mode == "raw" else 80)
        elif mode == "urllib":
            request = urllib.request.Request(URL, data=json.dumps(BODY).encode(), headers=HEADERS)
            request.add_header("Content-Type", "application/json")
            with urllib.request.urlopen(request, context=ssl.create_default_context(), timeout=30) as resp:
                print("urllib:", content(json.load(resp)), flush=True)
        elif mode == "loopback":
            with urllib.request.urlopen(os.environ["LOCAL_URL"] + "/v1/models", timeout=30) as resp:
                print("loopback:", json.load(resp)["data"][0]["id"], flush=True)
        elif mode == "banner":
            host, port = modes.pop(0).rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                print("banner:", sock.recv(100).decode().strip(), flush=True)
        elif mode == "udp":
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                try:
                    sock.sendto(b"quic?", ("8.8.8.8", 443))
                    print("udp: sent", flush=True)
                except OSError as exc:
                    print("udp: refused", exc.errno, flush=True)
        elif mode == "whoami":
            print("whoami:", os.stat("/proc/self/ns/net").st_ino, os.stat("/proc/self/ns/mnt").st_ino, os.getpid())
            sys.stdout.flush()
            time.sleep(300)
        else:
            sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
