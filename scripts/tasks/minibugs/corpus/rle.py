def rle_encode(text):
    """Run-length encoding: 'aaab' -> 'a3b1'."""
    if not text:
        return ""
    out = []
    current, count = text[0], 1
    for c in text[1:]:
        if c == current:
            count += 1
        else:
            out.append(f"{current}{count}")
            current, count = c, 1
    out.append(f"{current}{count}")
    return "".join(out)
