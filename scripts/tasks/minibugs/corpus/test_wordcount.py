import unittest

from wordcount import word_count


class WordCountTest(unittest.TestCase):
    def test_repeats(self):
        self.assertEqual(word_count("the cat and the hat"), {"the": 2, "cat": 1, "and": 1, "hat": 1})

    def test_case_and_punctuation(self):
        self.assertEqual(word_count("Go, go! GO."), {"go": 3})

    def test_empty(self):
        self.assertEqual(word_count(""), {})
        self.assertEqual(word_count(" ... "), {})


if __name__ == "__main__":
    unittest.main()
