def factorial(n):
    """n! for n >= 0."""
    if n < 0:
        raise ValueError("n must not be negative")
    result = 1
    for k in range(2, n + 1):
        result *= k
    return result
