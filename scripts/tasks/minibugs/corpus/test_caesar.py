import unittest

from caesar import caesar


class CaesarTest(unittest.TestCase):
    def test_lower(self):
        self.assertEqual(caesar("abc", 1), "bcd")

    def test_wrap(self):
        self.assertEqual(caesar("xyz", 3), "abc")

    def test_upper_and_other(self):
        self.assertEqual(caesar("Hello, World!", 13), "Uryyb, Jbeyq!")

    def test_back(self):
        self.assertEqual(caesar("bcd", -1), "abc")


if __name__ == "__main__":
    unittest.main()
