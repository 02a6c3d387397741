"""Shared test set-up: each stage keeps its fixtures in its own module (loaded below as pytest plugins)."""

import signal

pytest_plugins = [
    "fixtures_vllm",
    "fixtures_capture",
    "fixtures_dataset",
    "fixtures_train",
    "fixtures_ui",
    "fixtures_ray",
]

# A suite started in the background (`cmd &` in a script, nohup) inherits SIGINT ignored, and so
# would every lcap and agent it starts; several tests send SIGINT on purpose. A handler here makes
# the processes the tests start begin with SIGINT's default action, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
