"""`lcap deploy --merge`: a LoRA adapter merged into its base weights, as a full checkpoint vLLM can reload in place.

A server that hot-loads adapters runs vLLM's LoRA kernels on every call, which on a CPU costs a large part of its
decoding speed; merged weights decode as fast as the base. The merge is peft's `merge_and_unload` in float32 (the
base's own precision on a CPU), written beside the adapter (`ADAPTER-merged`, e.g. RUN/round-N/adapter-merged) as
safetensors with the base's config, generation and tokenizer files copied as they are, so the in-place reload's check
(serve/same_model.py) sees nothing but new weight values. The folder is written under a temporary name and renamed
into place: a reader never finds half a checkpoint. MARKER, beside the weights, names the adapter (and a digest of its
files) and the base: a merge of the same adapter is reused, and an adapter whose base is a merged checkpoint's own
base is checked against that base, which is what the next round of a loop continues from.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from lcap.config import LcapError

MARKER = "lcap-merge.json"  # in a merged checkpoint: {"adapter", "digest", "base"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def merged_path(adapter: Path) -> Path:
    """Where the merge of `adapter` is written: beside it, `ADAPTER-merged`."""
    return adapter.with_name(f"{adapter.name}-merged")


def files_digest(path: Path) -> str:
    """A digest of a folder's path and its files' names, sizes and mtimes: a retrained adapter gets another."""
    digest = hashlib.sha256(str(path).encode())
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        stat = file.stat()
        digest.update(f"{file.relative_to(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def root_base(model: str) -> str:
    """The base weights a served model was made from: a merged checkpoint's base (its MARKER), else the model."""
    try:
        return json.loads((Path(model) / MARKER).read_text())["base"]
    except (OSError, ValueError, KeyError, TypeError):
        return model


def adapter_base(adapter: Path) -> str:
    """The base model an adapter was trained on (its adapter_config.json's base_model_name_or_path)."""
    try:
        base = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    if not base:
        raise LcapError(f"{adapter}/adapter_config.json names no base model (base_model_name_or_path): cannot merge it")
    return str(base)


def check_merge_base(adapter: Path, served_model: str) -> str:
    """The adapter's base, when it is the base of the weights the server runs (`served_model`, the record's
    base_model); else a one-line refusal."""
    base, served = adapter_base(adapter), root_base(served_model)
    if _same_model(base, served):
        return served
    raise LcapError(
        f"adapter {adapter} was trained on {base}, but the policy server serves {served}: a merge would serve "
        "other weights than the adapter's (start `lcap serve` on its base, or deploy it without --merge)"
    )


def _same_model(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


def merge_adapter(adapter: Path, base: str) -> Path:
    """The adapter merged into `base` (float32), as a checkpoint at `merged_path(adapter)`: reused when it is the
    merge of these adapter files on this base already, else written whole under a temporary name and renamed."""
    out = merged_path(adapter)
    digest = files_digest(adapter)
    marker = {"adapter": str(adapter), "digest": digest, "base": base}
    try:
        if json.loads((out / MARKER).read_text()) == marker:
            return out
    except (OSError, ValueError):
        pass
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _write_merge(adapter, Path(base), tmp)
        (tmp / MARKER).write_text(json.dumps(marker, indent=2))
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_merge(adapter: Path, base: Path, out: Path) -> None:
    """peft's merge_and_unload of `adapter` on `base`, in float32, saved as safetensors in `out` with `base`'s
    other files (config, generation config, tokenizer) copied as they are."""
    import torch  # the train extra: torch, transformers and peft are the trainer's
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    if base.is_dir():
        for file in base.iterdir():
            if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES) and file.name not in WEIGHT_INDEXES:
                shutil.copy2(file, out / file.name)


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`; an older merge there is moved aside first and then removed."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
        out.rename(old / out.name)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
