def flatten(items):
    """Every non-list item of a nested list, in order."""
    out = []
    for item in items:
        if isinstance(item, list):
            out.extend(flatten(item))
        else:
            out.append(item)
    return out
