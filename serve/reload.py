"""A full checkpoint into a running vLLM replica without a restart: vLLM 0.32's dev-mode endpoints.

A replica lcap starts on loopback runs with VLLM_SERVER_DEV_MODE=1 (serve/vllm_process.py `launch`), which adds
`/pause`, `/resume`, `/is_paused` and `/collective_rpc`. vLLM's own `--api-key` does not guard them
(it checks only paths under /v1, /v2, /inference and /cohere), and `/collective_rpc` calls any worker
method, so lcap turns dev mode off for any replica that listens beyond 127.0.0.1 (Ray replicas: they
restart on a full checkpoint); vllm_guard.py, where it runs, wants the key on those paths too.

`reload_in_place` pauses the replica (`mode=wait`: new calls wait in vLLM's queue, calls in flight finish on the
weights they started on), reloads the weights from the checkpoint with the worker's `reload_weights` (through lcap's
worker extension, vllm_plugin/lcap_policy/reload.py), lets the caller switch the policy record (the replica is idle:
nothing it has answered came from the new weights, everything it answers from now on will), waits until every proxy
can have read the switch, and resumes. Whatever fails after the pause, the replica is resumed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from lcap.capture import REFRESH_S
from lcap.policy import bearer

log = logging.getLogger("lcap.serve")

SWITCH_GRACE_S = 2 * REFRESH_S  # between the record's switch and the resume: proxies re-read it (Router.settle)
CALL_TIMEOUT_S = 60.0  # /is_paused, /resume
RELOAD_TIMEOUT_S = 600.0  # reading a large checkpoint from disk
RELOAD_METHOD = "lcap_reload_weights"  # vllm_plugin/lcap_policy/reload.py: vLLM's reload_weights, and CPU repacking


class ReloadError(Exception):
    """The replica could not take the checkpoint in place."""


def can_reload(url: str, key: str | None) -> str | None:
    """None when the replica has the reload endpoints and is not paused; else why not."""
    try:
        answer = httpx.get(f"{url}/is_paused", headers=bearer(key), timeout=CALL_TIMEOUT_S, trust_env=False)
    except httpx.HTTPError as exc:
        return f"it did not answer ({exc})"
    if answer.status_code == 404:
        return "it runs without vLLM's reload endpoints (started before lcap turned them on: restart `lcap serve`)"
    if answer.status_code != 200:
        return f"/is_paused answered HTTP {answer.status_code}"
    try:
        paused = answer.json().get("is_paused")
    except (ValueError, AttributeError):
        return "/is_paused did not answer JSON"
    return "it is paused (another reload, or someone else's /pause)" if paused else None


def reload_in_place(
    url: str, key: str | None, checkpoint: Path, *, drain_timeout: float, switch: Callable[[], None], name: str = ""
) -> None:
    """Pause the replica at `url`, reload its weights from `checkpoint`, call `switch` (record the new deployment),
    wait SWITCH_GRACE_S, resume. Calls still in flight after `drain_timeout` finish on the new weights.

    ReloadError when vLLM refuses the checkpoint. vLLM's reload takes the model's layers apart before it reads the
    first tensor, so a reload that fails leaves a replica that cannot serve (a reload of the previous weights fails
    too): it is resumed, and the caller restarts it (serve/deploy.py). same_model.py's checks of the checkpoint's
    tensors come first so that this stays the exception (an unreadable file, a full disk)."""
    headers = bearer(key)
    paused = False
    try:
        started = time.monotonic()
        try:
            answer = httpx.post(
                f"{url}/pause", params={"mode": "wait"}, headers=headers, timeout=drain_timeout, trust_env=False
            )
            paused = True
            if answer.status_code != 200:
                raise ReloadError(f"/pause answered HTTP {answer.status_code}: {answer.text[:300]}")
        except httpx.TimeoutException:
            paused = True  # vLLM holds new calls from the moment it got the request, whatever the answer
            log.warning(
                "lcap: replica %s still had calls in flight after %.0fs (--drain-timeout): reloading anyway, they "
                "finish on the new weights",
                name,
                time.monotonic() - started,
            )
        except httpx.HTTPError as exc:
            paused = True  # it may have been received
            raise ReloadError(f"/pause failed: {exc}") from None
        _reload_weights(url, headers, checkpoint)
        switch()
        time.sleep(SWITCH_GRACE_S)
    finally:
        if paused:
            _resume(url, headers, name)


def _reload_weights(url: str, headers: dict[str, str], checkpoint: Path) -> None:
    body = {"method": RELOAD_METHOD, "kwargs": {"weights_path": str(checkpoint)}}
    try:
        answer = httpx.post(
            f"{url}/collective_rpc", json=body, headers=headers, timeout=RELOAD_TIMEOUT_S, trust_env=False
        )
    except httpx.HTTPError as exc:
        raise ReloadError(f"{RELOAD_METHOD}({checkpoint}) failed: {exc}") from None
    if answer.status_code != 200:
        raise ReloadError(f"{RELOAD_METHOD}({checkpoint}) answered HTTP {answer.status_code}: {answer.text[:300]}")


def _resume(url: str, headers: dict[str, str], name: str) -> None:
    """Resume, retried for CALL_TIMEOUT_S; ReloadError if it will not (the deploy then restarts the replica)."""
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while True:
        try:
            answer = httpx.post(f"{url}/resume", headers=headers, timeout=CALL_TIMEOUT_S, trust_env=False)
            if answer.status_code == 200:
                return
            why = f"HTTP {answer.status_code}"
        except httpx.HTTPError as exc:
            why = str(exc)
        if time.monotonic() > deadline:
            raise ReloadError(f"replica {name} did not resume ({why}): it holds every call sent to it until restarted")
        time.sleep(1.0)
