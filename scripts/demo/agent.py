"""The demo's agent: a plain OpenAI-SDK script. It knows nothing of lcap.

    python agent.py --question "Which is a number: code seven tool"

It calls https://api.openai.com like any agent would; under `lcap collect` / `lcap demo` the
capture proxy reroutes the call to the policy being trained and records its tokens.

The demo runs this script ~100 times a round on two cores, so it asks the client for the one
endpoint it uses (`client.post`, the SDK's documented way to call any path) instead of
`client.chat.completions`, whose first use imports every resource module of the SDK, a large
share of a short script's CPU. Same request, same typed `ChatCompletion` reply.
"""

import argparse

from openai import OpenAI
from openai.types.chat import ChatCompletion


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--question", required=True)
    parser.add_argument("--model", default="gpt-4o-mini")
    args = parser.parse_args()
    client = OpenAI()  # OPENAI_API_KEY from the environment, as usual
    reply = client.post(
        "/chat/completions",
        cast_to=ChatCompletion,
        body={
            "model": args.model,
            "messages": [{"role": "user", "content": args.question}],
            "max_tokens": 8,
            "temperature": 1.0,
        },
    )
    print(reply.choices[0].message.content or "")


if __name__ == "__main__":
    main()
