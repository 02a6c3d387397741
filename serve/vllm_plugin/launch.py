"""Start vLLM's OpenAI server with lcap's endpoints (run by `lcap serve` with vLLM's interpreter, `python -I`).

vLLM finds endpoint plugins through entry points and loads only those VLLM_PLUGINS names. This
script puts its own folder (the `lcap_policy` package and its `.dist-info`) first on the path and
names `lcap` in VLLM_PLUGINS; when VLLM_PLUGINS was not set, it also names every other plugin
installed, so that setting it does not turn off plugins vLLM would have loaded anyway.
"""

import os
import runpy
import sys
from importlib.metadata import entry_points

HERE = os.path.dirname(os.path.abspath(__file__))
GROUPS = ("vllm.general_plugins", "vllm.platform_plugins", "vllm.io_processor_plugins", "vllm.stat_logger_plugins")


def main() -> None:
    sys.path.insert(0, HERE)
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is None:
        names = {ep.name for group in GROUPS for ep in entry_points(group=group)}
    else:
        names = {name for name in allowed.split(",") if name}
    os.environ["VLLM_PLUGINS"] = ",".join(sorted(names | {"lcap"}))
    sys.argv[0] = "vllm.entrypoints.openai.api_server"
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
