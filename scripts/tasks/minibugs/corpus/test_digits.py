import unittest

from digits import digit_sum


class DigitSumTest(unittest.TestCase):
    def test_zero(self):
        self.assertEqual(digit_sum(0), 0)

    def test_one_digit(self):
        self.assertEqual(digit_sum(7), 7)

    def test_many_digits(self):
        self.assertEqual(digit_sum(12345), 15)
        self.assertEqual(digit_sum(1009), 10)

    def test_negative(self):
        self.assertEqual(digit_sum(-481), 13)


if __name__ == "__main__":
    unittest.main()
