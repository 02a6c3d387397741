"""Whether a full checkpoint differs from the running policy in anything but its weights' values.

An in-place reload (serve/reload.py) replaces weights only: vLLM keeps the model config, the generation defaults and
the tokenizer it started with. So a checkpoint whose tensors (names and shapes, from the safetensors headers),
config, generation config or tokenizer differs needs a restart. Trainers write these files again when they save
(another transformers version adds or renames fields, a tokenizer is re-serialised with `null` spelled `""`), so
they are compared for what vLLM reads from them, not byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

CONFIG_NOISE = frozenset({"_name_or_path", "transformers_version", "use_cache"})  # nothing vLLM serves by
RENAMED = {"torch_dtype": "dtype"}  # transformers 4.56 renamed it
TOKENIZER_SETTINGS = ("eos_token", "bos_token", "pad_token", "add_bos_token", "add_eos_token", "chat_template")
HEADER_MAX = 100 << 20  # bytes: safetensors' own limit on a header
PROBE = "Hello, world! <|im_start|>user\n  tabs\there, digits 12345, unicode \u00e9\u4e2d\U0001f600<|im_end|>\n"


def difference(checkpoint: Path, running: Path, tokenizer: Path) -> str | None:
    """What the checkpoint changes besides the weights' values, against the model dir `running` with its tokenizer
    from `tokenizer` (None: nothing). A checkpoint without tokenizer files is served with the running tokenizer."""
    tensors, before = _tensors(checkpoint), _tensors(running)
    if tensors is None or before is None:
        return "its weights or the running model's are not all in readable safetensors files"
    if tensors != before:
        changed = sorted(k for k in tensors.keys() | before.keys() if tensors.get(k) != before.get(k))
        return f"its tensors differ from the running model's in name or shape ({', '.join(changed[:3])}, ...)"
    for name in ("config.json", "generation_config.json"):
        changed = _changed_keys(_settings(checkpoint / name), _settings(running / name))
        if changed:
            return f"its {name} differs from the running model's ({', '.join(changed)})"
    if (checkpoint / "tokenizer.model").is_file() and not _same_bytes(checkpoint, tokenizer, "tokenizer.model"):
        return "its tokenizer.model differs from the running tokenizer's"
    if (checkpoint / "tokenizer.json").is_file() and not _same_tokenizer(checkpoint, tokenizer):
        return "its tokenizer.json tokenizes differently from the running tokenizer's"
    if (checkpoint / "tokenizer_config.json").is_file():
        changed = _changed_keys(_tokenizer_settings(checkpoint), _tokenizer_settings(tokenizer))
        if changed:
            return f"its tokenizer settings differ from the running tokenizer's ({', '.join(changed)})"
    return None


def _tensors(directory: Path) -> dict[str, list[int]] | None:
    """Every tensor's shape, from the safetensors headers (the data is not read); None when there is none."""
    shapes: dict[str, list[int]] = {}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    for file in files:
        try:
            with open(file, "rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                if not 0 < size <= HEADER_MAX:
                    return None
                header = json.loads(handle.read(size))
            shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return shapes


def _settings(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        return {"unreadable": path.read_bytes()}
    if not isinstance(data, dict):
        return {"unreadable": data}
    return {RENAMED.get(k, k): v for k, v in data.items() if k not in CONFIG_NOISE}


def _changed_keys(new: dict | None, old: dict | None) -> list[str]:
    if new is None or old is None:
        return [] if new is old else ["present in one only"]
    return sorted(k for k in new.keys() | old.keys() if new.get(k) != old.get(k))


def _tokenizer_settings(directory: Path) -> dict:
    settings = _settings(directory / "tokenizer_config.json") or {}
    out = {key: settings.get(key) for key in TOKENIZER_SETTINGS}
    for key in ("eos_token", "bos_token", "pad_token"):  # a token may be written as {"content": ...}
        token = out[key]
        if isinstance(token, dict):
            out[key] = token.get("content")
    template = directory / "chat_template.jinja"
    if template.is_file():
        out["chat_template"] = template.read_text()
    return out


def _same_bytes(a: Path, b: Path, name: str) -> bool:
    try:
        return (a / name).read_bytes() == (b / name).read_bytes()
    except FileNotFoundError:
        return False


def _same_tokenizer(a: Path, b: Path) -> bool:
    """Same vocabulary (added tokens included), and the same ids for a probe text and back."""
    try:
        first, second = Tokenizer.from_file(str(a / "tokenizer.json")), Tokenizer.from_file(str(b / "tokenizer.json"))
    except Exception:  # missing or unreadable: not provably the same
        return False
    if first.get_vocab(with_added_tokens=True) != second.get_vocab(with_added_tokens=True):
        return False
    ids = first.encode(PROBE).ids
    return ids == second.encode(PROBE).ids and first.decode(ids) == second.decode(ids)
