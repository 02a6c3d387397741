def word_count(text):
    """How often each word occurs, case ignored; words are split on whitespace, punctuation at their ends dropped."""
    counts = {}
    for raw in text.split():
        word = raw.strip(".,;:!?").lower()
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts
