"""The names other stages import from lcap.loop (lcap.faces): none; only the CLI registers its commands."""
