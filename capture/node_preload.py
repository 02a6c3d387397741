"""Node's built-in fetch ignores proxy variables: a `--require` preload routes it through the proxy."""


def install_node_preload() -> str:
    """Install the preload's npm packages into lcap's home (idempotent); return what was done."""
    raise NotImplementedError
