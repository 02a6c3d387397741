"""Shared fixtures. Each stage keeps its fixtures in its own module, imported here."""

import signal

from fixtures_capture import *  # noqa: F403
from fixtures_dataset import *  # noqa: F403
from fixtures_train import *  # noqa: F403
from fixtures_vllm import *  # noqa: F403  (policy server: tiny model + real vLLM CPU)

# A suite started in the background (`cmd &` in a script, nohup) inherits SIGINT ignored, and so
# would every lcap and agent it starts; several tests send SIGINT on purpose. A handler here makes
# the processes the tests start begin with SIGINT's default action, as from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
