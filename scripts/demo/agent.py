"""The demo's agent: a plain OpenAI-SDK script. It knows nothing of lcap.

    python agent.py --question "Reply with the middle word: code tool name"

It calls https://api.openai.com like any agent would; under `lcap collect` / `lcap demo` the
capture proxy reroutes the call to the policy being trained and records its tokens.
"""

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--question", required=True)
    parser.add_argument("--model", default="gpt-4o-mini")
    args = parser.parse_args()
    client = OpenAI()  # OPENAI_API_KEY from the environment, as usual
    reply = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": args.question}],
        max_tokens=8,
        temperature=1.0,
    )
    print(reply.choices[0].message.content or "")


if __name__ == "__main__":
    main()
