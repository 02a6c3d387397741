"""`lcap deploy`: make a new checkpoint the policy every routed call is served by, on every replica.

A PEFT LoRA adapter (a directory with adapter_config.json) is hot-loaded into every replica under a
new, unique name, and only then does the record's `current` name it: the proxy asks for the name it
reads there, so no call can reach a replica that lacks the adapter. Nothing restarts; calls in
flight finish on the old deployment. If one replica refuses the adapter, `current` stays as it was.

A full checkpoint (config.json + weights) that changes nothing but the weights (serve/same_model.py) is reloaded
into each local replica in place, one replica at a time (serve/reload.py): the replica pauses (new calls wait in
vLLM, calls in flight finish on the old weights, `drain_timeout` at most), reloads the weights, and the record maps
the new deployment to the name vLLM keeps serving (`served_as`) before the replica resumes. No call fails, and each
turn is labelled with the weights that served it (capture's Router.settle). Where that is not possible (another
config or tokenizer, Ray replicas, a server started without the reload endpoints, a reload vLLM refuses, or
`restart=True`) each vLLM is restarted on the checkpoint instead, with one log line saying why. The replicas roll
one at a time: the replica is marked draining in the record (the proxy routes its episodes to their next replica),
its calls in flight finish (vLLM's own request gauges reach zero, or `drain_timeout` passes), it restarts on the
checkpoint on the same address, and once healthy it rejoins the rotation serving the new deployment (its entry in
the record says so until all have rolled). One replica alone drains and restarts the same way: with every replica
draining, the proxy holds new calls until it serves again (capture/proxy/calls.py `Calls.hold`, `--hold-timeout`),
so they are answered late by the new deployment instead of failing. A replica that fails to start puts every replica
back on the previous policy, adapters included; if that fails too, no replica stays marked draining (the proxy would
hold calls for a server that is not coming back).

An adapter can also be loaded beside the current deployment without becoming current (`load_candidate`: what
`lcap loop --live` evaluates before it promotes it with `make_current`, and `lcap loop --per-role` one per role,
promoted together with `make_roles_current`); `lcap deploy --rollback`
(serve/rollback.py) makes an earlier deployment current again.

Each role of the agent (lcap/policy.py) can have an adapter of its own (`deploy_roles`): every role's adapter is
hot-loaded into every replica first, then one record write makes each the deployment of its role, so a deploy of
several roles is seen whole by every call routed after it and by none before. A role's deployment is a LoRA
adapter: full fine-tuning stays single-role, and a full checkpoint is refused while a role has an adapter of its
own (trained on the base it would replace).

Every deployment is a row in the store's `deployments` table (with its role), so each captured turn's `deployment`
says which policy produced it, and its `replica` which server.
"""

from __future__ import annotations

import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path

from lcap.config import LcapError
from lcap.policy import DEFAULT_ROLE, PolicyServer, policy_lock, publish, read_policy
from lcap.progress import Reporter
from lcap.serve.merge import check_merge_base, files_digest, merge_adapter, merged_path, root_base
from lcap.serve.reload import ReloadError, can_reload, reload_in_place
from lcap.serve.same_model import difference
from lcap.serve.server import in_flight, replicas_of
from lcap.serve.vllm_process import MAX_LORA_RANK, VllmSpec, flag_value
from lcap.store import Store, now

log = logging.getLogger("lcap.serve")

DRAIN_POLL_S = 0.5
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
SERVED_AS_KEPT = 64  # deployment -> vLLM name entries the record keeps (turns in flight may carry an older label)


def deploy_policy(
    path: Path,
    *,
    name: str | None = None,
    round: int | None = None,
    store: Store | None = None,
    drain_timeout: float = 600.0,
    restart: bool = False,
    merge: bool = False,
) -> str:
    """Deploy a LoRA adapter (hot-load; `merge`: merged into its base weights, then as a full checkpoint) or a full
    checkpoint (reload in place, else restart; `restart`: restart anyway) on every replica; return the deployment
    name now `current`."""
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise LcapError(f"{path} does not exist: deploy a round's adapter or checkpoint (RUN/round-N/adapter)")
    record = running_policy()  # a refusal is its one line, before any progress is shown
    lora = (path / "adapter_config.json").is_file()
    if not lora and not (path / "config.json").is_file():
        raise LcapError(f"{path} is neither a LoRA adapter (adapter_config.json) nor a checkpoint (config.json)")
    if merge:
        _check_merge(record, path, lora)
    with policy_lock(), Reporter("deploy", counted=False, doing=str(path)) as shown:
        record = running_policy()
        if lora and not merge:
            kind = "lora"
            name = name or _unique_name(path, round)
            shown.step(f"hot-loading the adapter {path} as {name} into {_replicas(record)}")
            record = _load_lora(record, path, name)
        else:
            kind = "merged" if merge else "full"
            name = name or _unique_name(path, round, merged=merge)
            weights = path
            if merge:  # checked again: the record may have changed while the lock was waited for
                base = _check_merge(record, path, lora)
                shown.step(f"merging the adapter {path} into {base}'s weights ({merged_path(path)})")
                weights = merge_adapter(path, base)
            else:
                _check_single_role(record, path)
            why = None if restart else _why_not_in_place(record, weights)
            if why is None and not restart:
                shown.step(f"reloading the weights of {weights} as {name} in place, {_replicas(record)} one at a time")
                try:
                    record = _reload(record, weights, name, drain_timeout)
                except ReloadError as exc:
                    why = f"the reload failed ({exc})"
            if why is not None or restart:
                if why is not None:
                    log.warning("lcap: deploying %s by restarting vLLM: %s", weights, why)
                shown.step(f"restarting {_replicas(record)} on {weights} as {name}, one at a time, each drained first")
                record = _roll(read_policy() or record, weights, name, drain_timeout)
        shown.doing = f"{name} is current"
    if store is not None:
        record_deployment(store, record, name, str(path), kind, round)
    return name


def _check_merge(record: PolicyServer, path: Path, lora: bool) -> str:
    """The base weights the adapter at `path` merges into; a refusal for anything but an adapter of the served base,
    or while roles have adapters."""
    if not lora:
        raise LcapError(f"{path} is not a LoRA adapter (adapter_config.json): --merge merges an adapter into its base")
    if record.roles:
        raise LcapError(
            f"roles {', '.join(sorted(record.roles))} have adapters of their own: one merged weight set cannot serve "
            "several roles (deploy without --merge, or roll each role back first: `lcap deploy --rollback --role R`)"
        )
    return check_merge_base(path, record.base_model)


def weights_of(kind: str, path: str) -> str:
    """The weights a `deployments` row's deployment runs on: a merged one's merge, else its own path."""
    return str(merged_path(Path(path))) if kind == "merged" else path


def _replicas(record: PolicyServer) -> str:
    return "the replica" if len(record.replicas) == 1 else f"{len(record.replicas)} replicas"


def running_policy() -> PolicyServer:
    """The policy record; LcapError when no policy server is running."""
    record = read_policy()
    if record is None:
        raise LcapError("no policy server is running: start one with `lcap serve --model M`")
    return record


def check_lora_rank(record: PolicyServer, rank: int, what: str) -> None:
    """Refuse an adapter of `rank` (`what`: how to name it) that the server has no LoRA slot for."""
    if not record.lora:
        raise LcapError(
            f"{what}: the policy server runs without LoRA (`lcap serve --no-lora`), so an adapter deploys only merged "
            "into the weights (`lcap deploy --merge`, `lcap loop --deploy-merge`)"
        )
    allowed = int(flag_value(record.vllm_args, "--max-lora-rank") or MAX_LORA_RANK)
    if rank > allowed:
        raise LcapError(
            f"{what} has rank {rank}; the server allows at most {allowed} "
            f"(restart it with `lcap serve ... -- --max-lora-rank {rank}`)"
        )


def _load_lora(record: PolicyServer, path: Path, name: str, *, current: bool = True) -> PolicyServer:
    _load_loras(record, {name: path})
    if current:
        record.current = name
    publish(record)
    return record


def _load_loras(record: PolicyServer, loras: dict[str, Path]) -> None:
    """Hot-load `loras` (name -> adapter) into every replica and list them in `record` (not published yet)."""
    if root_base(record.base_model) != record.base_model:
        raise LcapError(
            f"the policy server runs merged weights ({record.base_model}): an adapter hot-loaded on them would add "
            "its change twice; deploy it with --merge, or deploy the base model first"
        )
    for path in loras.values():
        config = json.loads((path / "adapter_config.json").read_text())
        rank = max([config.get("r") or 0, *(config.get("rank_pattern") or {}).values()])
        check_lora_rank(record, rank, f"adapter {path}")
    _load_everywhere(record, {name: str(path) for name, path in loras.items()})
    record.loras.update({name: str(path) for name, path in loras.items()})


def deploy_roles(
    paths: dict[str, Path], *, name: str | None = None, round: int | None = None, store: Store | None = None
) -> dict[str, str]:
    """Make each role's LoRA adapter in `paths` (role -> adapter) its deployment: every adapter is hot-loaded into
    every replica, then one record write switches every role named (`default`: `current`), so no call is routed by
    part of it. `name`: the served name, for one role only. Returns role -> the deployment it now asks for."""
    if name is not None and len(paths) > 1:
        raise LcapError("--name names one deployment: leave it out when deploying several roles")
    adapters = {role: Path(path).expanduser().resolve() for role, path in paths.items()}
    for role, path in adapters.items():
        if not path.exists():
            raise LcapError(f"--role {role}: {path} does not exist: deploy a round's adapter (RUN/round-N/adapter)")
        if not (path / "adapter_config.json").is_file():
            raise LcapError(
                f"--role {role}: {path} is not a LoRA adapter (adapter_config.json); a role's deployment is an "
                "adapter (full fine-tuning stays single-role: deploy a checkpoint without --role)"
            )
    names = {role: name or _unique_name(path, round, role) for role, path in adapters.items()}
    running_policy()  # a refusal is its one line, before any progress is shown
    with policy_lock(), Reporter("deploy", counted=False) as shown:
        record = running_policy()
        said = ", ".join(f"{role} {names[role]}" for role in adapters)
        shown.step(f"hot-loading the adapters of {said} into {_replicas(record)}")
        _load_loras(record, {names[role]: path for role, path in adapters.items()})
        _switch_roles(record, names)
        publish(record)
        shown.doing = f"{said} deployed"
    if store is not None:
        for role, path in adapters.items():
            record_deployment(store, record, names[role], str(path), "lora", round, role=role)
    return names


def _check_single_role(record: PolicyServer, path: Path) -> None:
    """Refuse a full checkpoint while a role has an adapter of its own: it was trained on the base being replaced."""
    if record.roles:
        roles = ", ".join(sorted(record.roles))
        raise LcapError(
            f"{path} is a full checkpoint, and role(s) {roles} have adapters of their own on the base model it would "
            f"replace: roll each back to the default's deployment first (`lcap deploy --rollback --role ROLE`)"
        )


def _switch_roles(record: PolicyServer, names: dict[str, str]) -> None:
    """Make each deployment in `names` (role -> a served name) its role's in `record` (`default`: `current`)."""
    for role, served in names.items():
        if role == DEFAULT_ROLE:
            record.current = served
        else:
            record.roles[role] = served


def load_candidate(path: Path, *, round: int | None = None, role: str = DEFAULT_ROLE) -> str:
    """Hot-load a LoRA adapter into every replica under a new name (that `role`'s deployment would have) without
    making it current: calls that ask for that name (an evaluation's proxy, `--model NAME` or a role pin) reach it,
    routed calls keep the current deployment. Returns the name; `make_current` (`make_roles_current`) promotes it,
    `forget_candidate` drops it from the record."""
    path = Path(path).expanduser().resolve()
    if not (path / "adapter_config.json").is_file():
        raise LcapError(
            f"{path} is not a LoRA adapter (adapter_config.json): only an adapter can be served beside the policy"
        )
    with policy_lock():
        record = running_policy()
        name = _unique_name(path, round, role)
        _load_lora(record, path, name, current=False)
    return name


def make_current(name: str) -> PolicyServer:
    """Make `name`, a deployment the replicas already serve (a loaded adapter, the base model, or the weights
    reloaded in place), the current one: routed calls ask for it once this returns (the record is published)."""
    with policy_lock():
        record = running_policy()
        if not servable(record, name):
            raise LcapError(f"the policy server does not serve {name!r}: deploy its adapter or checkpoint again")
        record.current = name
        publish(record)
    return record


def make_roles_current(names: dict[str, str]) -> PolicyServer:
    """Make each loaded adapter in `names` (role -> its served name) its role's deployment in one record write, as
    `deploy_roles` does once it has loaded them: no call is routed by part of it."""
    with policy_lock():
        record = running_policy()
        missing = sorted(name for name in names.values() if name not in record.loras)
        if missing:
            raise LcapError(f"the policy server does not serve {', '.join(missing)}: deploy their adapters again")
        _switch_roles(record, names)
        publish(record)
    return record


def servable(record: PolicyServer, name: str) -> bool:
    """Whether the replicas serve deployment `name` now, without loading anything."""
    return name in record.loras or name == record.served_model or name in record.served_as


def forget_candidate(name: str) -> None:
    """Drop a candidate that was not promoted from the record (a restarted replica does not load it again)."""
    with policy_lock():
        record = read_policy()
        if record is not None and name in record.loras and name not in record.in_use():
            del record.loras[name]
            publish(record)


def record_deployment(
    store: Store,
    record: PolicyServer,
    name: str,
    path: str,
    kind: str,
    round: int | None,
    rollback_of: str | None = None,
    role: str = DEFAULT_ROLE,
) -> None:
    """The `deployments` row of a deployment made `role`'s (current, for the default role)."""
    row = {"name": name, "path": path, "base_model": record.base_model, "kind": kind, "round": round, "role": role}
    store.append("deployments", [{**row, "created_at": now(), "rollback_of": rollback_of}])


def _load_everywhere(record: PolicyServer, loras: dict[str, str], only: str | None = None) -> None:
    """Hot-load `loras` (name -> path) into every replica (or the one named `only`), in parallel; LcapError naming
    each replica that failed."""
    if not loras:
        return
    backend = replicas_of(record)
    key = record.api_key()
    targets = [r for r in record.replicas if only is None or r.name == only]
    with ThreadPoolExecutor(len(targets)) as pool:
        futures = {
            replica.name: [pool.submit(backend.load_lora, replica, lora, Path(p), key) for lora, p in loras.items()]
            for replica in targets
        }
    errors = [f"{n}: {f.exception()}" for n, fs in futures.items() for f in fs if f.exception() is not None]
    if errors:
        raise LcapError(
            f"not every replica loaded {', '.join(loras.values())}, so every role keeps its deployment: "
            + "; ".join(errors)
        )


def _why_not_in_place(record: PolicyServer, path: Path) -> str | None:
    """None when every replica can reload the checkpoint in place; else why it must restart."""
    if record.ray_address is not None:
        return "Ray replicas restart on a full checkpoint (each actor supervises vLLM on the model it was given)"
    if any(replica.serving(record) in record.loras for replica in record.replicas):
        return "a LoRA adapter is the running deployment (calls the pause holds would get it on the new weights)"
    running = Path(record.base_model)
    if not (running / "config.json").is_file():
        return f"the running model {record.base_model} is not a local checkpoint to compare the new one with"
    why = difference(path, running, Path(flag_value(record.vllm_args, "--tokenizer") or running))
    if why is not None:
        return why
    key = record.api_key()
    for replica in record.replicas:
        if (why := can_reload(replica.url, key)) is not None:
            return f"replica {replica.name}: {why}"
    return None


def _reload(record: PolicyServer, path: Path, name: str, drain_timeout: float) -> PolicyServer:
    """Reload the checkpoint into the replicas in place, one at a time; each serves `name` from its switch on."""
    served, key = record.served_model, record.api_key()

    def switch(replica_name: str) -> None:
        now_record = read_policy()
        if now_record is None:
            raise ReloadError("the policy record disappeared during the deploy (`lcap serve --stop`?)")
        now_record.served_as = _served_as(now_record.served_as, name, served)
        now_record.replica(replica_name).current = name
        publish(now_record)

    for replica in record.replicas:
        reload_in_place(
            replica.url, key, path, drain_timeout=drain_timeout, switch=partial(switch, replica.name), name=replica.name
        )
    return _serving_checkpoint(record, path, name)


def _served_as(mapping: dict[str, str], name: str, served: str) -> dict[str, str]:
    """`mapping` with `name` -> `served` last, at most SERVED_AS_KEPT entries (the oldest go)."""
    out = {k: v for k, v in mapping.items() if k != name}
    if name != served:
        out[name] = served
    return dict(list(out.items())[-SERVED_AS_KEPT:])


def _roll(record: PolicyServer, path: Path, name: str, drain_timeout: float) -> PolicyServer:
    """Restart the replicas on the checkpoint one at a time; on a failure, put every replica back as it was."""
    previous = VllmSpec.of(record)
    args = _with_tokenizer(record, path)
    target = replace(previous, model=str(path), served_name=name, extra_args=tuple(args))
    touched: list[str] = []
    try:
        for replica in record.replicas:
            touched.append(replica.name)
            _replace(replica.name, target, drain_timeout=drain_timeout)
    except LcapError as exc:
        for replica_name in touched:  # the failed one too: it may be down, or half started
            try:
                _replace(replica_name, previous, drain_timeout=drain_timeout, loras=record.loras)
            except LcapError as again:
                _undrain()
                raise LcapError(
                    f"checkpoint {path} did not start ({exc}), and replica {replica_name} did not start again on "
                    f"{record.current!r} either: {again}"
                ) from None
        raise LcapError(f"checkpoint {path} did not start, so {record.current!r} is serving again: {exc}") from None
    except BaseException:  # interrupted (Ctrl-C) mid-roll
        _undrain()
        raise
    return _serving_checkpoint(record, path, name, served_model=name)


def _serving_checkpoint(record: PolicyServer, path: Path, name: str, served_model: str | None = None) -> PolicyServer:
    """Record every replica serving the checkpoint at `path` as deployment `name` (vLLM under `served_model`, when
    it restarted on it): a replica restarted later starts on these weights, with no adapter (a reload drops them)."""
    serving = read_policy() or record
    serving.vllm_args = _with_tokenizer(serving, path)
    serving.base_model, serving.current, serving.loras = str(path), name, {}
    if served_model is not None:
        serving.served_model = served_model
    for replica in serving.replicas:
        replica.current = None
    publish(serving)
    return serving


def _replace(name: str, spec: VllmSpec, *, drain_timeout: float, loras: dict[str, str] | None = None) -> None:
    """Take replica `name` out of the rotation, let its calls finish, restart it on `spec` (with `loras`) and put
    it back in the rotation serving `spec`. A replica alone is taken out too: the proxy then holds new calls
    until it is back."""
    record = read_policy()
    if record is None:
        raise LcapError("the policy record disappeared during the deploy (`lcap serve --stop`?)")
    replica = record.replica(name)
    replica.draining = True
    publish(record)
    _drain(replica.url, record.api_key(), name, drain_timeout)
    restarted = replicas_of(record).restart(replica, spec)
    record = read_policy() or record
    for i, entry in enumerate(record.replicas):
        if entry.name == name:
            record.replicas[i] = restarted
    if loras:
        _load_everywhere(record, loras, only=name)
    restarted.draining = False
    restarted.current = None if spec.served_name == record.current else spec.served_name
    if loras and record.current in loras:
        restarted.current = None
    publish(record)


def _undrain() -> None:
    """Mark no replica draining: after a deploy that could not bring a replica back, calls go to the replicas
    as they are (and fail fast where one is down) instead of being held for one that is not coming."""
    record = read_policy()
    if record is not None and any(r.draining for r in record.replicas):
        for replica in record.replicas:
            replica.draining = False
        publish(record)


def _drain(url: str, key: str | None, name: str, timeout: float) -> None:
    """Wait until the replica has no request running or waiting (twice in a row), or `timeout` passes. (The record
    that marked it draining was published: no call is routed to it meanwhile.)"""
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 2:
        count = in_flight(url, key)
        if count is None:  # down, or no metrics: nothing to wait for
            return
        quiet = quiet + 1 if count == 0 else 0
        if time.monotonic() > deadline:
            log.warning(
                "lcap: replica %s still had %d calls in flight after %.0fs (--drain-timeout): restarting it anyway",
                name,
                count,
                timeout,
            )
            return
        time.sleep(DRAIN_POLL_S)


def _with_tokenizer(record: PolicyServer, path: Path) -> list[str]:
    """The record's vLLM arguments for a checkpoint: trainers often save weights only, and then the tokenizer comes
    from where the running policy's came from."""
    args = list(record.vllm_args)
    own = [i for i, arg in enumerate(args) if arg == "--tokenizer" or arg.startswith("--tokenizer=")]
    if any((path / f).is_file() for f in TOKENIZER_FILES):
        for i in reversed(own):
            del args[i : i + (1 if "=" in args[i] else 2)]
        return args
    return args if own else [*args, "--tokenizer", record.base_model]


def check_round(path: Path, round: int, store: Store | None) -> None:
    """Refuse a --round that no round is known by: below 1, another than the round folder the path is in
    (RUN/round-K/adapter), or, outside a round folder, one the store has no episode, training run or deployment of."""
    if round < 1:
        raise LcapError(f"--round must be 1 or more (the training round that produced {path}), not {round}")
    folder = Path(path).expanduser().resolve().parent.name
    if re.fullmatch(r"round-\d+", folder):
        if int(folder.removeprefix("round-")) != round:
            raise LcapError(f"{path} is in {folder}: it is that round's output, not round {round}'s (--round)")
        return
    known = (
        store is not None
        and store.fetchall(
            "SELECT (SELECT count(*) FROM episodes WHERE round = $r) + (SELECT count(*) FROM train_runs WHERE round = $r)"
            " + (SELECT count(*) FROM deployments WHERE round = $r)",
            {"r": round},
        )[0][0]
    )
    if not known:
        raise LcapError(
            f"no round {round} anywhere: the store has no episode, training run or deployment of round {round}; "
            "pass the round that trained it, or leave --round out"
        )


def _unique_name(path: Path, round: int | None, role: str = DEFAULT_ROLE, *, merged: bool = False) -> str:
    """`policy-r{round}-{hash}` (`policy-{role}-r{round}-{hash}` for another role than the default,
    `policy-merged-r{round}-{hash}` for an adapter deployed merged): the hash covers the files' names, sizes and
    mtimes, so a retrained adapter gets a new name."""
    prefix = "policy" if role == DEFAULT_ROLE else f"policy-{role}"
    prefix = f"{prefix}-merged" if merged else prefix
    prefix = f"{prefix}-r{round}" if round is not None else prefix
    return f"{prefix}-{files_digest(path)[:8]}"
