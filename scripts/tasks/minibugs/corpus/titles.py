SMALL = {"a", "an", "and", "of", "the"}


def title_case(text):
    """Each word capitalised, except small words that are not the first."""
    words = text.lower().split()
    out = []
    for i, word in enumerate(words):
        if i > 0 and word in SMALL:
            out.append(word)
        else:
            out.append(word[0].upper() + word[1:])
    return " ".join(out)
