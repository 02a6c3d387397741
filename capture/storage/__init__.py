"""The spool -> writer -> DuckDB path: finished calls on disk at once, stored in batches by a writer process; on a Ray node, in an outbox that the driver's ingest empties into its own spool.

May import: lcap's core and capture.turns."""
