def chunk(values, size):
    """values cut into lists of `size` items; the last one may be shorter."""
    if size < 1:
        raise ValueError("size must be at least 1")
    out = []
    for start in range(0, len(values), size):
        out.append(values[start : start + size])
    return out
