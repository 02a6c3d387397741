def moving_average(values, window):
    """The mean of each `window` consecutive values."""
    if window < 1:
        raise ValueError("window must be at least 1")
    out = []
    total = 0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
