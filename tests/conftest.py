"""Shared fixtures. Each stage keeps its fixtures in its own module, imported here."""

from fixtures_vllm import *  # noqa: F401,F403  (policy server: tiny model + real vLLM CPU)
from fixtures_capture import *  # noqa: F401,F403
from fixtures_dataset import *  # noqa: F401,F403
from fixtures_train import *  # noqa: F401,F403
