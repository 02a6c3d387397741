"""A single-turn agent: asks the model one question with the openai SDK and prints the answer.

A plain script, as a user would write it: it calls https://api.openai.com (the SDK's default)
with OPENAI_API_KEY and knows nothing of lcap. `--write PATH=TEXT` also writes a file in its
working directory (what a coding agent's edit tool does).
"""

import argparse
import os

from openai import OpenAI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--question", required=True)
    ap.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"))
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--write", action="append", default=[], metavar="PATH=TEXT")
    args = ap.parse_args()

    client = OpenAI()
    response = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": args.question}],
        max_tokens=args.max_tokens,
    )
    answer = response.choices[0].message.content or ""
    for item in args.write:
        path, _, text = item.partition("=")
        with open(path, "w") as f:
            f.write(text)
    with open("answer.txt", "w") as f:
        f.write(answer)
    print(answer)


if __name__ == "__main__":
    main()
