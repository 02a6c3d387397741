def rotate(values, k):
    """values rotated right by k places (left for negative k)."""
    if not values:
        return []
    k = k % len(values)
    return values[-k:] + values[:-k] if k else list(values)
