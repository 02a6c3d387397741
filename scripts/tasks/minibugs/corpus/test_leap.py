import unittest

from leap import is_leap


class LeapTest(unittest.TestCase):
    def test_common(self):
        self.assertFalse(is_leap(2023))

    def test_fourth(self):
        self.assertTrue(is_leap(2024))

    def test_century(self):
        self.assertFalse(is_leap(1900))

    def test_fourth_century(self):
        self.assertTrue(is_leap(2000))


if __name__ == "__main__":
    unittest.main()
