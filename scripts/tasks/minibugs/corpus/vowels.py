def count_vowels(text):
    """How many of the letters a, e, i, o, u (either case) text holds."""
    count = 0
    for c in text.lower():
        if c in "aeiou":
            count += 1
    return count
