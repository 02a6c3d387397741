"""Reaching the proxy from an agent: the environment and listeners each episode's agent gets (`agent_env.py`), `--transparent` namespaces and their DNS, the JVM's settings, Node's preload, and which process a loopback connection comes from.

May import: lcap's core and capture.trust. The front it hands an episode's listeners to is named by its shape only (`listeners.py`), never imported."""
