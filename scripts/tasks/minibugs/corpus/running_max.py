def running_max(values):
    """The largest value seen so far, at each position."""
    out = []
    best = None
    for v in values:
        if best is None or v > best:
            best = v
        out.append(best)
    return out
