def count_bits(n):
    """How many 1 bits the binary form of n >= 0 has."""
    if n < 0:
        raise ValueError("n must not be negative")
    count = 0
    while n:
        count += n & 1
        n >>= 1
    return count
