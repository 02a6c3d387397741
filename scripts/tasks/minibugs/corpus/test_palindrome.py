import unittest

from palindrome import is_palindrome


class PalindromeTest(unittest.TestCase):
    def test_simple(self):
        self.assertTrue(is_palindrome("level"))
        self.assertFalse(is_palindrome("levels"))

    def test_punctuation_and_case(self):
        self.assertTrue(is_palindrome("A man, a plan, a canal: Panama"))

    def test_empty_and_single(self):
        self.assertTrue(is_palindrome(""))
        self.assertTrue(is_palindrome("x"))

    def test_almost(self):
        self.assertFalse(is_palindrome("abca"))
        self.assertFalse(is_palindrome("ab"))
        self.assertTrue(is_palindrome("abba"))


if __name__ == "__main__":
    unittest.main()
