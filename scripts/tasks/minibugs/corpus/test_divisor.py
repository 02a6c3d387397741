import unittest

from divisor import gcd


class GcdTest(unittest.TestCase):
    def test_common(self):
        self.assertEqual(gcd(12, 18), 6)
        self.assertEqual(gcd(18, 12), 6)

    def test_coprime(self):
        self.assertEqual(gcd(17, 5), 1)

    def test_zero(self):
        self.assertEqual(gcd(0, 9), 9)
        self.assertEqual(gcd(9, 0), 9)
        self.assertEqual(gcd(0, 0), 0)

    def test_negative(self):
        self.assertEqual(gcd(-8, 12), 4)


if __name__ == "__main__":
    unittest.main()
