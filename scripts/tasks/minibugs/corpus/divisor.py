def gcd(a, b):
    """The greatest common divisor of two integers (0 for gcd(0, 0))."""
    a, b = abs(a), abs(b)
    while b != 0:
        a, b = b, a % b
    return a
