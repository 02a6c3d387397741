"""Does vLLM 0.32's dev-mode in-place weight reload work on CPU? (docs/architecture.md, "Serving and deploys")

    .venv/bin/python benchmarks/probe_vllm_reload.py [wait|keep|abort] [DIR]

Starts vLLM (lcap's venv) with VLLM_SERVER_DEV_MODE=1 on the tiny model, makes a checkpoint of it with
perturbed weights, and while streaming completions run: POST /pause?mode=MODE, POST /collective_rpc
{"method": "reload_weights", "kwargs": {"weights_path": CKPT}}, POST /resume. Prints each call's answer and
time, every stream's status and chunk count, and whether greedy logprobs changed (the new weights serve).
lcap does not deploy this way yet; this is the evidence the design note quotes.
"""

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

root = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/lcap-probe-reload")
root.mkdir(parents=True, exist_ok=True)
model = root / "tiny"
if not (model / "config.json").exists():
    subprocess.run([str(Path(sys.executable).parent / "lcap"), "init-model", str(model)], check=True)
ckpt = root / "ckpt"
shutil.rmtree(ckpt, ignore_errors=True)
shutil.copytree(model, ckpt)
f = next(ckpt.glob("*.safetensors"))
w = load_file(f)
torch.manual_seed(0)
w = {k: (v + 0.05 * torch.randn_like(v) if v.dtype.is_floating_point and v.dim() == 2 else v) for k, v in w.items()}
save_file(w, f, metadata={"format": "pt"})

py = os.path.expanduser("~/.lcap/vllm-venv/bin/python")
port = 18555
env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
log = open(root / "vllm.log", "w")
proc = subprocess.Popen(
    [
        py,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--max-model-len",
        "2048",
        "--dtype",
        "float32",
    ],
    env=env,
    stdout=log,
    stderr=subprocess.STDOUT,
    start_new_session=True,
)
url = f"http://127.0.0.1:{port}"
try:
    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, (root / "vllm.log").read_text()[-3000:]
        assert time.monotonic() - t0 < 600
        time.sleep(1)
    print(f"server up in {time.monotonic() - t0:.0f}s")
    body = {
        "model": "tiny",
        "prompt": "Which is a number: code seven tool",
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 1,
    }

    def lp():
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        return r["choices"][0]["logprobs"]["token_logprobs"], r["choices"][0]["text"]

    before = lp()
    print("before", before)
    results = []

    def streamer():
        for _ in range(6):
            try:
                with httpx.stream(
                    "POST",
                    f"{url}/v1/completions",
                    json={**body, "max_tokens": 48, "temperature": 1.0, "stream": True, "ignore_eos": True},
                    timeout=300,
                ) as r:
                    chunks = [c for c in r.iter_lines() if c.startswith("data:")]
                    results.append((r.status_code, len(chunks), chunks[-1][:40] if chunks else None))
            except Exception as e:
                results.append(("error", repr(e)))

    th = threading.Thread(target=streamer)
    th.start()
    time.sleep(1.0)
    for mode in (sys.argv[1] if len(sys.argv) > 1 else "wait",):
        t = time.monotonic()
        r = httpx.post(f"{url}/pause", params={"mode": mode}, timeout=300)
        print("pause", mode, r.status_code, r.text, f"{time.monotonic() - t:.2f}s")
        t = time.monotonic()
        r = httpx.post(
            f"{url}/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(ckpt)}},
            timeout=300,
        )
        print("reload", r.status_code, r.text[:500], f"{time.monotonic() - t:.2f}s")
        r = httpx.post(f"{url}/resume", timeout=60)
        print("resume", r.status_code, r.text)
    th.join()
    print("streams", results)
    after = lp()
    print("after", after)
    print("changed:", before != after)
finally:
    os.killpg(proc.pid, 15)
    proc.wait(30)
