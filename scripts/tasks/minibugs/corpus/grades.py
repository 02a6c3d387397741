def letter_grade(score):
    """'A' from 90, 'B' from 80, 'C' from 70, 'D' from 60, else 'F' (scores 0 to 100)."""
    if score < 0 or score > 100:
        raise ValueError("score must be between 0 and 100")
    if score >= 90:
        return "A"
    if score >= 80:
        return "B"
    if score >= 70:
        return "C"
    if score >= 60:
        return "D"
    return "F"
