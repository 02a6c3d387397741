import unittest

from primes import is_prime


class PrimeTest(unittest.TestCase):
    def test_small(self):
        self.assertEqual([n for n in range(20) if is_prime(n)], [2, 3, 5, 7, 11, 13, 17, 19])

    def test_squares(self):
        self.assertFalse(is_prime(9))
        self.assertFalse(is_prime(25))
        self.assertFalse(is_prime(49))

    def test_larger(self):
        self.assertTrue(is_prime(97))
        self.assertFalse(is_prime(91))

    def test_negative(self):
        self.assertFalse(is_prime(-7))


if __name__ == "__main__":
    unittest.main()
