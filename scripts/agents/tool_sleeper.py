"""An agent whose episodes spend most of their time in tool calls of uneven length, as real agents do.

Before each of its `--calls` calls to the model (openai SDK, chat completions, the conversation growing each
time) it runs a "tool" that takes a long-tailed random time: a log-normal duration with median `--median`
seconds and shape `--sigma`, capped at `--cap`, drawn from a generator seeded by `--seed` and the episode
(LCAP_TASK's id and `--sample`), so a run is reproducible. It prints the last answer. It calls
https://api.openai.com with OPENAI_API_KEY and knows nothing of lcap. Like the demo's agent it asks the client
for the one endpoint it uses (`client.post`): the script is short, the SDK's full import is not.
"""

import argparse
import hashlib
import json
import os
import random
import time

from openai import OpenAI
from openai.types.chat import ChatCompletion


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--question", required=True)
    ap.add_argument("--sample", default="0", help="which member of its group this episode is (seeds the tool time)")
    ap.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"))
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--median", type=float, default=1.0, help="median tool time, seconds")
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal shape: larger is a longer tail")
    ap.add_argument("--cap", type=float, default=60.0, help="longest tool time, seconds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    task = json.loads(os.environ.get("LCAP_TASK") or "{}").get("id", args.question)
    key = f"{args.seed}:{task}:{args.sample}".encode()
    rng = random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))
    client = OpenAI()
    messages = [{"role": "user", "content": args.question}]
    answer = ""
    for call in range(args.calls):
        time.sleep(min(args.cap, args.median * rng.lognormvariate(0.0, args.sigma)))  # the tool runs
        if call:
            messages.append({"role": "user", "content": f"Tool result {call}: done. Answer again."})
        body = {"model": args.model, "messages": messages, "max_tokens": args.max_tokens, "temperature": 1.0}
        reply = client.post("/chat/completions", cast_to=ChatCompletion, body=body)
        answer = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
    print(answer)


if __name__ == "__main__":
    main()
