"""Reaching agents that ignore proxy settings: `--transparent` namespaces and their DNS, the JVM's settings, Node's preload, and which process a loopback connection comes from.

May import: lcap's core, capture.trust and capture.proxy (the front a namespace's listener hands connections to)."""
