"""A full-checkpoint deploy on one vLLM CPU replica while agents stream calls: restart vs in-place reload.

Usage: .venv/bin/python benchmarks/bench_full_deploy.py [ROUNDS] [THREADS]

Starts `lcap serve` on the tiny model (one replica) and the capture proxy, runs THREADS agents that
stream chat completions back to back through the proxy, and deploys a new checkpoint (the tiny model
with other weights, same config) ROUNDS times in each mode, alternating: `restart` (lcap deploy
--restart: the replica drains, vLLM restarts on it, the proxy holds the calls sent meanwhile) and `in-place`
(serve/reload.py: pause, reload the weights, resume). An agent whose call fails waits RETRY_S before
its next. Prints per deploy its wall time, the calls that failed, and the longest call that overlapped
it (what an agent waits at worst); then the medians and the failed calls of each mode, side by side. benchmarks/probe_vllm_reload.py is the bare vLLM
probe this grew from.
"""

from __future__ import annotations

import os
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


RETRY_S = 0.5  # an agent's pause after a failed call, before its next one


class Agents:
    """THREADS agents streaming calls back to back through the proxy until stopped; every call's outcome is kept
    (a stream cut mid-way counts as failed, as an agent sees it)."""

    def __init__(self, proxy, threads: int) -> None:
        self.proxy, self.threads = proxy, threads
        self.calls: list[dict] = []
        self.stop = threading.Event()
        self.workers = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(threads)]

    def __enter__(self) -> Agents:
        for worker in self.workers:
            worker.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for worker in self.workers:
            worker.join(300)

    def wait_for(self, n: int) -> None:
        start = len([c for c in self.calls if c["ok"]])
        while len([c for c in self.calls if c["ok"]]) < start + n:
            time.sleep(0.1)

    def _run(self, worker: int) -> None:
        import httpx
        from openai import OpenAI

        env = self.proxy.child_env(f"bench-{worker}", base={})
        verify = ssl.create_default_context(cafile=env["SSL_CERT_FILE"])
        with httpx.Client(proxy=env["HTTPS_PROXY"], verify=verify, timeout=300) as http:
            client = OpenAI(api_key="lcap-bench-placeholder", http_client=http, max_retries=0)
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    stream = client.chat.completions.create(
                        model="gpt-4o-mini", messages=MESSAGES, max_tokens=24, stream=True
                    )
                    ok = bool(list(stream))
                except Exception:  # refused, cut, or an error answer: the agent sees a failed call
                    ok = False
                self.calls.append({"ok": ok, "started": started, "ended": time.monotonic()})
                if not ok:
                    time.sleep(RETRY_S)


MESSAGES = [{"role": "user", "content": "Count from one to ten, please."}]


def main(rounds: int, threads: int) -> None:
    from fixtures_vllm import perturbed_checkpoint

    from lcap.capture.options import ProxyOptions
    from lcap.capture.proxy.server import CaptureProxy
    from lcap.policy import read_policy
    from lcap.serve.deploy import deploy_policy
    from lcap.serve.server import start_server, stop_server
    from lcap.serve.tiny_model import init_model
    from lcap.serve.vllm_process import resolve_python
    from lcap.store import Store

    python = resolve_python()
    work = Path(tempfile.mkdtemp(prefix="lcap-bench-deploy-"))
    os.environ["LCAP_HOME"] = str(work / "home")
    os.environ["LCAP_POLICY_RECORD"] = str(work / "home" / "policy.json")
    (work / "home").mkdir()
    model = init_model(work / "tiny")
    checkpoints = [perturbed_checkpoint(model, work / f"ckpt-{k}", seed=k + 1) for k in range(2)]
    t0 = time.monotonic()
    start_server(str(model), python=python, served_name="tiny", log_path=work / "vllm.log", timeout=900)
    print(f"server up in {time.monotonic() - t0:.0f} s; {threads} agents streaming 24-token answers", flush=True)
    results: dict[str, list[tuple[float, int, float]]] = {"restart": [], "in-place": []}
    store = Store(work / "lcap.duckdb")
    try:
        with CaptureProxy(store, ProxyOptions(upstream="policy")) as proxy:
            deploys = 0
            for i in range(rounds):
                for mode in ("restart", "in-place"):
                    with Agents(proxy, threads) as agents:
                        agents.wait_for(2 * threads)
                        pid = read_policy().pid
                        started = time.monotonic()
                        name = deploy_policy(
                            checkpoints[deploys % 2],
                            name=f"{mode}-{i}",
                            round=deploys,
                            store=store,
                            restart=mode == "restart",
                            drain_timeout=120,
                        )
                        ended = time.monotonic()
                        deploys += 1
                        agents.wait_for(2 * threads)
                    restarted = read_policy().pid != pid
                    assert restarted == (mode == "restart"), f"{mode}: the server was restarted: {restarted}"
                    failed = sum(not c["ok"] for c in agents.calls)
                    overlapping = [c for c in agents.calls if c["started"] < ended and c["ended"] > started]
                    worst = max((c["ended"] - c["started"] for c in overlapping), default=0.0)
                    results[mode].append((ended - started, failed, worst))
                    print(
                        f"{mode:8s} deploy {name}: {ended - started:6.2f} s, {len(agents.calls)} calls, "
                        f"{failed} failed, longest call overlapping the deploy {worst:6.2f} s",
                        flush=True,
                    )
    finally:
        stop_server()
    print()
    print("| mode | deploy time (median) | failed calls (all deploys) | longest overlapping call (median) |")
    print("|---|---|---|---|")
    for mode, rows in results.items():
        print(
            f"| {mode} | {statistics.median(r[0] for r in rows):.2f} s | {sum(r[1] for r in rows)} "
            f"of {len(rows)} deploys | {statistics.median(r[2] for r in rows):.2f} s |"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2, int(sys.argv[2]) if len(sys.argv) > 2 else 3)
