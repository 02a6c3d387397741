"""`lcap init-model`: a tiny random-init Qwen2-style causal LM that vLLM can serve on CPU.

No weights can be downloaded on a machine without internet, and tests and the demo need a policy
that vLLM really serves, LoRA really changes and TRL really trains. So lcap makes one: a Qwen2
config (head_dim 64, the smallest size vLLM's CPU attention handles well), random weights from a
seeded generator, and a byte-level BPE tokenizer trained here on a corpus built in code (digits,
arithmetic, the words of prompts and instructions, JSON and tool-call syntax). The chat template
is Qwen2.5's ChatML with tools in the system turn and `<tool_call>` JSON blocks, which vLLM's
`hermes` tool parser understands. Same seed and sizes, same bytes on disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from lcap.config import LcapError
from lcap.serve.options import TinyModelOptions

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]
# Added but not special (as in Qwen2.5): they survive skip_special_tokens, so tool parsers see them.
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# Qwen2.5's template, plus: content given as a list of parts, and arguments given either as a JSON
# string (OpenAI messages, rendered in-process) or as an object (vLLM parses them before rendering).
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- elif content is not none -%}{{ content }}
{%- endif -%}
{%- endmacro -%}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- render_content(messages[0].content) }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + render_content(message.content) }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# The words of prompts and instructions, in the order the tokenizer sees them (a few twice).
_WORDS = """
the a an of to in on at for with by from and or not is are was be it this that these those you your we our they
their he she his her as if then else when while do does did done can could should would will may might must have has
had get got make made use used using give gave take took find found show see look read write wrote run ran call
called return returns result results answer answers question questions task tasks step steps solve solved solution
compute calculate add added sum plus minus times divide divided multiply multiplied subtract product difference
quotient total number numbers digit digits value values equal equals zero one two three four five six seven eight
nine ten hundred thousand first second third last next final only each every all any some none more less than most
least how what which who why where much many please tell explain reason reasoning think thought check verify correct
wrong true false yes no ok okay done error errors fail failed success pass passed test tests file files line lines
code function functions tool tools argument arguments name names type types string integer float boolean object
array list dict key keys item items input output user assistant system message messages content role request
response model models agent agents policy reward rewards episode episode turn turns sample data query search open
close start stop end word words text letter letters count counts length reverse sort sorted order upper lower case
python print import def class self math json shell command commands bash echo cat ls grep help helpful concise brief
short long format only exactly respond reply output must should
"""

CORPUS_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the documents for a query.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
]


def _corpus() -> list[str]:
    """Texts the tokenizer learns its merges from; built in code so the result is reproducible."""
    words = _WORDS.split()
    texts = [" ".join(words), " ".join(w.capitalize() for w in words), "\n".join(words)]
    for a in range(0, 100, 3):
        for b in range(1, 30, 7):
            texts.append(f"What is {a} + {b}? The answer is {a + b}.")
            texts.append(f"Compute {a} * {b} - {a}. Answer: {a * b - a}")
            texts.append(f"{a} / {b} = {a / b:.2f}; {a} - {b} = {a - b}")
    for tool in CORPUS_TOOLS:
        texts.append(json.dumps(tool))
        texts.append(json.dumps(tool, indent=2))
        name = tool["function"]["name"]
        texts.append(
            f'<tool_call>\n{{"name": "{name}", "arguments": {{"expression": "12 * 7", "query": "sum", "path": "a.txt"}}}}\n</tool_call>'
        )
        texts.append('<tool_response>\n{"result": 84, "ok": true, "error": null}\n</tool_response>')
    texts.append(CHAT_TEMPLATE)
    texts += [
        f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n{IM_START}user\nWhat is 2 + 2?{IM_END}\n"
        f"{IM_START}assistant\nThe answer is 4.{IM_END}\n",
        '{"role": "user", "content": "Please solve the task and return only the final answer."}',
        '{"messages": [{"role": "system", "content": "Be concise."}], "tools": [], "tool_choice": "auto"}',
        "[1, 2, 3] {} [] () <> == != <= >= && || ... :: -> => # Tools\n\n",
    ]
    return texts


def _train_tokenizer(vocab_size: int):
    # Exactly Qwen2's normalizer and pre-tokenizer (one digit per token): transformers loads a
    # qwen2 model's tokenizer as Qwen2Tokenizer, which installs these whatever tokenizer.json says.
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def init_model(out: Path, options: TinyModelOptions = TinyModelOptions()) -> Path:
    """Write a random-init Qwen2ForCausalLM with its tokenizer and chat template to `out`.

    Deterministic: the same options give the same bytes. The defaults make a model small enough that vLLM
    starts on CPU in seconds; pass larger sizes for a demo that should learn more.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise LcapError(f"{out} exists and is not empty")

    # the train extra
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(options.vocab_size),
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=options.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=options.hidden_size,
        intermediate_size=options.intermediate_size or 2 * options.hidden_size,
        num_hidden_layers=options.num_layers,
        num_attention_heads=options.num_heads,
        num_key_value_heads=options.num_kv_heads or options.num_heads,
        max_position_embeddings=options.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),  # type: ignore[arg-type]  # an int for one token
        dtype="float32",
    )
    torch.manual_seed(options.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()  # type: ignore[arg-type]  # transformers' wrapped .to
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id, config.pad_token_id],
        pad_token_id=config.pad_token_id,
        max_new_tokens=options.max_new_tokens,
    )
    return save_checkpoint(model, tokenizer, out)


def save_checkpoint(model: Any, tokenizer: Any, out: Path) -> Path:
    """Write a model and its tokenizer to `out`, the tokenizer's class named as every transformers release knows
    it (v5 writes its new `TokenizersBackend`)."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
