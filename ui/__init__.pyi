"""The names other stages import from lcap.ui (lcap.faces): none; only the CLI registers its commands."""
