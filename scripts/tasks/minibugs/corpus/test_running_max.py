import unittest

from running_max import running_max


class RunningMaxTest(unittest.TestCase):
    def test_empty(self):
        self.assertEqual(running_max([]), [])

    def test_rising_and_falling(self):
        self.assertEqual(running_max([1, 3, 2, 5, 4]), [1, 3, 3, 5, 5])

    def test_negative(self):
        self.assertEqual(running_max([-5, -7, -2]), [-5, -5, -2])

    def test_first_is_largest(self):
        self.assertEqual(running_max([9, 1, 2]), [9, 9, 9])


if __name__ == "__main__":
    unittest.main()
