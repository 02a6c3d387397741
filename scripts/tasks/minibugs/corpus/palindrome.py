def is_palindrome(text):
    """True when text reads the same both ways, counting only letters and digits, case ignored."""
    chars = [c.lower() for c in text if c.isalnum()]
    i, j = 0, len(chars) - 1
    while i < j:
        if chars[i] != chars[j]:
            return False
        i += 1
        j -= 1
    return True
