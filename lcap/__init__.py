"""lcap: reinforcement learning for any LLM agent, without touching the agent."""

__version__ = "0.1.0"
