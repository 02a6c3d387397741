"""`lcap deploy`: make a new checkpoint the policy every routed call is served by.

A PEFT LoRA adapter (a directory with adapter_config.json) is hot-loaded into the running vLLM
under a new, unique name: nothing restarts, calls in flight finish on the old deployment, and new
calls (the proxy rereads the record) ask for the new name. A full checkpoint (config.json +
weights) needs a restart of vLLM on it, on the same port. Every deployment is a row in the
store's `deployments` table, so each captured turn's `deployment` says which policy produced it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx

from lcap.config import LcapError
from lcap.policy import PolicyServer, read_policy, write_policy
from lcap.store import Store, now


def deploy(path: Path, *, name: str | None = None, round: int | None = None, store: Store | None = None) -> str:
    """Deploy a LoRA adapter (hot-load) or a full checkpoint (restart); return the served name now `current`."""
    path = Path(path).expanduser().resolve()
    record = read_policy()
    if record is None:
        raise LcapError("no policy server is running: start one with `lcap serve --model M`")
    if (path / "adapter_config.json").is_file():
        kind = "lora"
        name = name or _unique_name(path, round)
        record = _load_lora(record, path, name)
    elif (path / "config.json").is_file():
        kind = "full"
        name = name or _unique_name(path, round)
        record = _restart_on(record, path, name)
    else:
        raise LcapError(f"{path} is neither a LoRA adapter (adapter_config.json) nor a checkpoint (config.json)")
    if store is not None:
        store.append(
            "deployments",
            [
                {
                    "name": name,
                    "path": str(path),
                    "base_model": record.base_model,
                    "kind": kind,
                    "round": round,
                    "created_at": now(),
                }
            ],
        )
    return name


def _load_lora(record: PolicyServer, path: Path, name: str) -> PolicyServer:
    from lcap.serve.server import MAX_LORA_RANK

    config = json.loads((path / "adapter_config.json").read_text())
    rank = max([config.get("r") or 0, *(config.get("rank_pattern") or {}).values()])
    if rank > MAX_LORA_RANK:
        raise LcapError(
            f"adapter {path} has rank {rank}; the server allows at most {MAX_LORA_RANK} (restart `lcap serve` with a larger --max-lora-rank)"
        )
    # In place: deploying a name again (a resumed loop, or a retrained adapter under a fixed name) replaces it.
    body = {"lora_name": name, "lora_path": str(path), "load_inplace": True}
    try:
        response = httpx.post(f"{record.url}/v1/load_lora_adapter", json=body, timeout=600)
    except httpx.HTTPError as exc:
        raise LcapError(
            f"policy server at {record.url} did not answer ({exc}): is it running? `lcap serve --status`"
        ) from None
    if response.status_code != 200:
        raise LcapError(f"vLLM refused adapter {path} ({response.status_code}): {_error_text(response)}")
    record = read_policy() or record  # another deploy may have touched the record meanwhile
    record.loras[name] = str(path)
    record.current = name
    write_policy(record)
    return record


def _restart_on(record: PolicyServer, path: Path, name: str) -> PolicyServer:
    """Replace the running vLLM by one on the checkpoint, on the same port, so the URL stays valid."""
    from lcap.serve.server import start_server, stop_server

    port = int(record.url.rsplit(":", 1)[1])
    extra: list[str] = []
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        extra = ["--tokenizer", record.base_model]  # trainers often save weights only
    stop_server()
    try:
        return start_server(
            str(path),
            port=port,
            python=record.python,
            served_name=name,
            log_path=Path(record.log_path),
            extra_args=extra,
        )
    except LcapError as exc:
        # Leave the agents a policy: bring the previous one back (base and adapters), then report.
        previous = start_server(
            record.base_model,
            port=port,
            python=record.python,
            served_name=record.served_model,
            log_path=Path(record.log_path),
        )
        for lora, lora_path in record.loras.items():
            previous = _load_lora(previous, Path(lora_path), lora)
        previous.current = record.current
        write_policy(previous)
        raise LcapError(f"checkpoint {path} did not start, so {record.current!r} is serving again: {exc}") from None


def _unique_name(path: Path, round: int | None) -> str:
    """`policy-r{round}-{hash}`: the hash covers the files' names, sizes and mtimes, so a retrained adapter gets a new name."""
    digest = hashlib.sha256(str(path).encode())
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        stat = file.stat()
        digest.update(f"{file.relative_to(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    prefix = f"policy-r{round}" if round is not None else "policy"
    return f"{prefix}-{digest.hexdigest()[:8]}"


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
        return str((body.get("error") or {}).get("message") or body)
    except ValueError:
        return response.text[:500]
