"""What `--sandbox` adds to one episode: set-up and teardown, measured around an agent that does nothing.

    .venv/bin/python benchmarks/bench_sandbox.py [--episodes 40] [--template-files 20]

One capture proxy (no upstream), one store in a temporary folder; the same episodes (`/bin/true` as the agent, a
task whose template holds --template-files small files) run one after another through `run_episode`, first
without a sandbox, then with one, alternating in pairs so that load on the machine falls on both alike. Prints
the median and the 90th percentile of each, and their difference: what the sandbox adds per episode (its tmpfs
workspace mounted, filled and unmounted, its cgroups made and removed, bubblewrap started, the listener made in
its network namespace). Needs what `--sandbox` needs (root, bubblewrap, cgroups v1). Target: <= 50 ms added.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lcap.capture.options import ProxyOptions, SandboxLimits
from lcap.capture.proxy.server import CaptureProxy
from lcap.capture.sandbox import Sandbox, missing
from lcap.dataset.collect.episode import EpisodeRules, EpisodeSpec, TaskFiles, run_episode
from lcap.store import Store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--template-files", type=int, default=20)
    args = parser.parse_args()
    if reason := missing():
        sys.exit(f"bench_sandbox: {reason}")
    base = Path(tempfile.mkdtemp(prefix="lcap-bench-sandbox-"))
    base.chmod(0o755)
    os.environ["LCAP_HOME"] = str(base / "home")
    template = base / "tasks" / "template"
    template.mkdir(parents=True)
    for i in range(args.template_files):
        (template / f"file{i}.py").write_text("x = 1\n" * 50)
    store = Store(base / "db" / "lcap.duckdb")
    proxy = CaptureProxy(store, ProxyOptions(upstream=None))
    proxy.start()
    try:
        run_dir = base / "runs"
        run_dir.mkdir()
        sandbox = Sandbox(SandboxLimits(512, 64, 64), proxy, [run_dir], [store.path])
        rules = EpisodeRules(None, (), 30.0)
        files = TaskFiles(base / "tasks")
        times: dict[str, list[float]] = {"plain": [], "sandbox": []}
        for n in range(args.episodes):
            for kind in ("plain", "sandbox") if n % 2 else ("sandbox", "plain"):
                eid = f"bench-{kind}-{n}"
                spec = EpisodeSpec(eid, {"id": "t", "template": "template"}, 0, ["/bin/true"], run_dir / eid, {})
                start = time.perf_counter()
                with proxy.episode_child(eid, spec.argv) as agent:
                    outcome = run_episode(
                        spec,
                        agent.env,
                        rules,
                        files,
                        flush=lambda: True,
                        agent=agent,
                        sandbox=sandbox if kind == "sandbox" else None,
                    )
                times[kind].append(time.perf_counter() - start)
                if outcome.status != "ok":
                    sys.exit(f"bench_sandbox: episode {eid} {outcome.status}: {outcome.reason}")
    finally:
        proxy.stop()
    rows = {k: (statistics.median(v) * 1e3, statistics.quantiles(v, n=10)[-1] * 1e3) for k, v in times.items()}
    for kind, (median, p90) in rows.items():
        print(f"{kind:8s} episode: median {median:6.1f} ms, p90 {p90:6.1f} ms ({args.episodes} episodes)")
    added = rows["sandbox"][0] - rows["plain"][0]
    print(f"--sandbox adds {added:.1f} ms per episode (median; target <= 50 ms)")


if __name__ == "__main__":
    main()
