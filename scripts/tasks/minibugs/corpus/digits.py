def digit_sum(n):
    """The sum of the decimal digits of n (its sign ignored)."""
    n = abs(n)
    total = 0
    while n > 0:
        total += n % 10
        n //= 10
    return total
