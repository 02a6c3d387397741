def is_anagram(a, b):
    """True when a and b use the same letters the same number of times (case and spaces ignored)."""
    a = a.replace(" ", "").lower()
    b = b.replace(" ", "").lower()
    if len(a) != len(b):
        return False
    counts = {}
    for c in a:
        counts[c] = counts.get(c, 0) + 1
    for c in b:
        if counts.get(c, 0) == 0:
            return False
        counts[c] -= 1
    return True
