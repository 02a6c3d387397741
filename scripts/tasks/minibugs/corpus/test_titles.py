import unittest

from titles import title_case


class TitleCaseTest(unittest.TestCase):
    def test_plain(self):
        self.assertEqual(title_case("hello world"), "Hello World")

    def test_small_words(self):
        self.assertEqual(title_case("the lord of the rings"), "The Lord of the Rings")

    def test_shouting(self):
        self.assertEqual(title_case("WAR AND PEACE"), "War and Peace")

    def test_empty(self):
        self.assertEqual(title_case(""), "")


if __name__ == "__main__":
    unittest.main()
