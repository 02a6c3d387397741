import unittest

from anagram import is_anagram


class AnagramTest(unittest.TestCase):
    def test_yes(self):
        self.assertTrue(is_anagram("listen", "silent"))
        self.assertTrue(is_anagram("Dormitory", "dirty room"))

    def test_no(self):
        self.assertFalse(is_anagram("abc", "abd"))
        self.assertFalse(is_anagram("aab", "abb"))

    def test_lengths(self):
        self.assertFalse(is_anagram("abc", "ab"))
        self.assertTrue(is_anagram("", ""))


if __name__ == "__main__":
    unittest.main()
