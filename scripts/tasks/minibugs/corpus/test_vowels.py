import unittest

from vowels import count_vowels


class VowelsTest(unittest.TestCase):
    def test_word(self):
        self.assertEqual(count_vowels("banana"), 3)

    def test_upper_case(self):
        self.assertEqual(count_vowels("EDUCATION"), 5)

    def test_none(self):
        self.assertEqual(count_vowels("rhythm"), 0)
        self.assertEqual(count_vowels(""), 0)


if __name__ == "__main__":
    unittest.main()
