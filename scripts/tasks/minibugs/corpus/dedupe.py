def dedupe(values):
    """values without repeats, each kept where it first occurs."""
    seen = set()
    out = []
    for v in values:
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out
