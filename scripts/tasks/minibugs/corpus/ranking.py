def second_largest(values):
    """The second largest distinct value, or None when there are fewer than two."""
    first = second = None
    for v in values:
        if first is None or v > first:
            if first is not None:
                second = first
            first = v
        elif v != first and (second is None or v > second):
            second = v
    return second
