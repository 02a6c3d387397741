"""Secrets and trust: lcap's CA and the bundle children trust (`ca.py`), the TLS certificates made with it, episode credentials, redaction of what is stored, and where an exposed proxy may connect.

May import: lcap's core."""
