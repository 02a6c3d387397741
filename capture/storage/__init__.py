"""The spool -> writer -> DuckDB path: finished calls on disk at once, stored in batches by a writer process (or an outbox on a Ray node).

May import: lcap's core and capture.turns."""
