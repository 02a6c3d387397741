"""Secrets and trust: episode credentials, redaction of what is stored, where an exposed proxy may connect, and the TLS certificates made with lcap's CA.

May import: lcap's core."""
