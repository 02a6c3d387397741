def overlap(a, b):
    """The length shared by the closed intervals a = (start, end) and b, 0 when they do not meet."""
    start = max(a[0], b[0])
    end = min(a[1], b[1])
    if end <= start:
        return 0
    return end - start
