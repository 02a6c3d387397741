"""Core's redaction of what came from the user's invocation (#54): credential-named assignments and flags in a
command line, labels. Key shapes themselves: tests/integration/test_capture_secrets.py (with detect-secrets)."""

from __future__ import annotations

import shlex

import pytest

from lcap.redact import REDACTED, redact_labels, redact_text

R = REDACTED


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        (  # `env NAME=VALUE` inside a `bash -c` script, as shlex.join writes it
            shlex.join(["bash", "-c", "env CODEX_API_KEY=hunter2 python agent.py --word x"]),
            f"bash -c 'env CODEX_API_KEY={R} python agent.py --word x'",
        ),
        ("export OPENAI_API_KEY=abc; python a.py", f"export OPENAI_API_KEY={R}; python a.py"),
        ("GITHUB_TOKEN=t1 A_SECRET=s1 DB_PASSWORD=p1 run", f"GITHUB_TOKEN={R} A_SECRET={R} DB_PASSWORD={R} run"),
        ("MY_PASSWORD_FILE=x apiKey=y key=z", f"MY_PASSWORD_FILE={R} apiKey={R} key={R}"),
        ("A_SECRET='a b c' next", f"A_SECRET='{R}' next"),  # a quoted value, whole
        ("agent --api-key hunter2 --model m", f"agent --api-key {R} --model m"),  # a flag and its value
        ("agent --api-key=hunter2 --token tok -v", f"agent --api-key={R} --token {R} -v"),
        ('{"api_key": "hello world", "n": 1}', f'{{"api_key": "{R}", "n": 1}}'),
        ("curl -H 'x-api-key: abcdef123456'", f"curl -H 'x-api-key: {R}'"),
        ("echo sk-proj-abcdefghij0123456789XYZ done", f"echo {R} done"),  # a key's shape, whatever names it
    ],
)
def test_credential_named_values_and_key_shapes_are_replaced(text, redacted):
    assert redact_text(text) == redacted


@pytest.mark.parametrize(
    "text",
    [
        "python agent.py --max-tokens 100 --model m max_tokens=5 monkey=3",  # names that only hold a secret's word
        "env PWD=/home/me LANG=C python a.py",
        "agent --password -v",  # a flag with no value after it
        "unexpected token: foo",  # prose with a short word after a colon
    ],
)
def test_other_text_is_left_alone(text):
    assert redact_text(text) == text


def test_labels_lose_credential_named_values_and_key_shapes():
    labels = {"api_key": "plain", "note": "key=abc and sk-proj-abcdefghij0123456789XYZ", "task": "t1", "round": 3}
    assert redact_labels(labels) == {"api_key": R, "note": f"key={R} and {R}", "task": "t1", "round": 3}
