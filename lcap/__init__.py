"""lcap: reinforcement learning for any LLM agent, without touching the agent."""

from lcap.noise import quiet_noise

__version__ = "0.1.0"

quiet_noise()
