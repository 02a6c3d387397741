"""`lcap train --ray ADDRESS --num-workers N [--use-gpu]`: one round on a Ray cluster, with Ray Train.

Ray Train's `TorchTrainer` starts N workers (one GPU each with --use-gpu, NCCL; else CPU workers,
gloo), joins them in one torch.distributed group and sets the variables accelerate reads (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR). Each worker then runs `fit_round`: the same TRL trainer and
the same code as a single process or one process of an `accelerate launch`.

No shared file system is assumed. The driver (the machine `lcap train` runs on) puts the round's
samples and the previous round's adapter in Ray's object store; each worker trains in a scratch
folder on its node; rank 0 returns the adapter's files, TRL's logs and the round's figures, and
the driver writes them into RUN/round-N, config.json and the store, once. The base model is
loaded by name on each node, or from a folder that must exist on every node.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

from lcap.config import LcapError
from lcap.ray_cluster import connect, describe
from lcap.train.fit import FittedRound, RoundInputs, UserPaths, fit_round, round_folder
from lcap.train.options import TrainOptions

# What rank 0 may send back (the adapter and TRL's logs): a LoRA adapter is a small part of its model.
MAX_RETURN_BYTES = 4 << 30
MAX_REPORT_BYTES = 1 << 20  # build-dataset's report.json shipped with the samples (a few KiB)


def fit_on_ray(inputs: RoundInputs, out_dir: Path, options: TrainOptions) -> FittedRound:
    """Train the round on `options.num_workers` Ray Train workers; write what rank 0 made into OUT_DIR."""
    import ray  # the ray extra

    # Ray Train v2 by name (the default in Ray 2.60; RAY_TRAIN_V2_ENABLED=0 would swap in v1, which has no return_value)
    from ray.train.v2.api.config import RunConfig, ScalingConfig
    from ray.train.v2.api.result import Result
    from ray.train.v2.torch.torch_trainer import TorchTrainer

    connect(options.ray or "auto")
    _check_resources(options, describe(options.ray or "auto"))
    base_model = inputs.base_model
    local_model = Path(base_model).exists()
    if local_model:
        base_model = str(Path(base_model).resolve())  # a worker's working directory is not this one
    config = {
        "samples": ray.put(Path(inputs.samples).read_bytes()),
        "report": _report(Path(inputs.samples)),
        "init_from": ray.put(_pack(inputs.init_from)) if inputs.init_from else None,
        "init_name": inputs.init_from.name if inputs.init_from else None,
        "base_model": base_model,
        "local_model": local_model,
        "current": inputs.current,
        "options": options,
        "round_name": round_folder(out_dir),
        "user_paths": UserPaths(
            Path(inputs.samples).resolve(), inputs.init_from.resolve() if inputs.init_from else None, out_dir.resolve()
        ),
    }
    storage = Path(tempfile.mkdtemp(prefix="lcap-ray-train-"))  # Ray Train's own run state; nothing of ours
    try:
        trainer = TorchTrainer(
            _train_worker,
            train_loop_config=config,
            scaling_config=ScalingConfig(
                num_workers=options.num_workers,
                use_gpu=options.use_gpu,
                resources_per_worker={"CPU": options.cpus_per_worker, **({"GPU": 1} if options.use_gpu else {})},
            ),
            run_config=RunConfig(name=f"lcap-{round_folder(out_dir).replace('/', '-')}", storage_path=str(storage)),
        )
        try:
            result = cast(Result, trainer.fit())  # ray.train's Result, as mypy reads it, is v1's
        except Exception as exc:
            error = _user_error(exc, out_dir)
            if error is None:
                raise
            raise error from None
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    returned = result.return_value
    if not returned:
        raise RuntimeError(f"Ray Train finished without rank 0's output: {result.error!r}")
    _unpack(returned["files"], out_dir)
    fitted = returned["fitted"]
    return FittedRound(**{**fitted, "output": out_dir / fitted["output"]})


def _train_worker(config: dict[str, Any]) -> dict[str, Any] | None:
    """One Ray Train worker: materialise the round's inputs on this node, train, and (rank 0) return the output."""
    import ray  # the ray extra
    import ray.train  # the ray extra

    options: TrainOptions = config["options"]
    base_model = config["base_model"]
    if config["local_model"] and not Path(base_model).exists():
        raise LcapError(
            f"base model {base_model} is a folder on the driver's machine, not on node "
            f"{ray.util.get_node_ip_address()}: put it on every node at that path, or use a model name"
        )
    scratch = Path(tempfile.mkdtemp(prefix="lcap-train-worker-"))
    try:
        samples = scratch / "data" / "samples.parquet"
        samples.parent.mkdir()
        samples.write_bytes(ray.get(config["samples"]))
        if config.get("report") is not None:  # where a round with nothing to train on finds why (fit.py)
            (samples.parent / "report.json").write_bytes(config["report"])
        init_from = None
        if config["init_from"] is not None:
            init_from = scratch / "init" / config["init_name"]
            _unpack(ray.get(config["init_from"]), init_from)
        inputs = RoundInputs(
            base_model=base_model,
            samples=samples,
            init_from=init_from,
            current=config["current"],
            user_paths=config["user_paths"],
        )
        out_dir = scratch / config["round_name"]
        try:
            fitted = fit_round(inputs, out_dir, options)
        except LcapError as exc:  # the guard's figures (each worker writes them) go where its error says they are
            report = out_dir / "mismatch.json"
            raise _RoundStopped(str(exc), {report.name: report.read_bytes()} if report.exists() else {}) from None
        if ray.train.get_context().get_world_rank() != 0:
            return None
        return {"files": _pack(out_dir), "fitted": {**asdict(fitted), "output": fitted.output.name}}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _report(samples: Path) -> bytes | None:
    """build-dataset's report beside the samples, shipped with them: a worker on another host cannot read the
    driver's file, and without it a round with nothing to train on could not say why."""
    path = samples.parent / "report.json"
    try:
        if path.stat().st_size > MAX_REPORT_BYTES:
            return None
        return path.read_bytes()
    except OSError:
        return None


def _pack(folder: Path) -> dict[str, bytes]:
    """Every file under FOLDER by its relative path, within MAX_RETURN_BYTES."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    if total > MAX_RETURN_BYTES:
        raise LcapError(
            f"{folder} holds {total / 2**30:.1f} GiB, more than Ray ships back ({MAX_RETURN_BYTES / 2**30:.0f} GiB): "
            "lower --lora-r, or train with --accelerate-config on a shared file system"
        )
    return {str(p.relative_to(folder)): p.read_bytes() for p in files}


def _unpack(files: dict[str, bytes], folder: Path) -> None:
    root = Path(folder).resolve()
    for name, data in files.items():
        path = (root / name).resolve()
        if not path.is_relative_to(root):
            raise ValueError(f"refusing to write {name!r} outside {root}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _check_resources(options: TrainOptions, address: str) -> None:
    """Fail at once, not after Ray's wait for resources, when the cluster can never hold the workers."""
    import ray  # the ray extra

    total = ray.cluster_resources()
    cpus, gpus = options.num_workers * options.cpus_per_worker, options.num_workers if options.use_gpu else 0
    if total.get("CPU", 0) < cpus or total.get("GPU", 0) < gpus:
        raise LcapError(
            f"the Ray cluster at {address} has {total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs; "
            f"{options.num_workers} workers need {cpus} CPUs" + (f" and {gpus} GPUs" if gpus else "")
        )


class _RoundStopped(LcapError):
    """A worker's one-line error, with the files of the round it names (OUT_DIR's, by name) for the driver."""

    def __init__(self, message: str, files: dict[str, bytes]) -> None:
        super().__init__(message, files)
        self.message, self.files = message, files

    def __str__(self) -> str:
        return self.message


def _user_error(exc: Exception, out_dir: Path) -> LcapError | None:
    """A worker's LcapError (bad input) as the one-line error it is, instead of Ray's report of a failed run; the
    files it names (rank 0's) are written into OUT_DIR."""
    failures = getattr(exc, "worker_failures", None) or {}
    causes = [getattr(failure, "cause", failure) for failure in failures.values()]
    errors = sorted((c for c in causes if isinstance(c, LcapError)), key=lambda c: not getattr(c, "files", None))
    if not errors:
        return None
    _unpack(getattr(errors[0], "files", None) or {}, out_dir)
    return LcapError(str(errors[0]))
