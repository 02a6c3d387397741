import unittest

from roman import to_roman


class RomanTest(unittest.TestCase):
    def test_small(self):
        self.assertEqual([to_roman(n) for n in (1, 3, 4, 5, 9)], ["I", "III", "IV", "V", "IX"])

    def test_larger(self):
        self.assertEqual(to_roman(14), "XIV")
        self.assertEqual(to_roman(40), "XL")
        self.assertEqual(to_roman(90), "XC")
        self.assertEqual(to_roman(400), "CD")
        self.assertEqual(to_roman(1994), "MCMXCIV")

    def test_limits(self):
        self.assertEqual(to_roman(3999), "MMMCMXCIX")
        with self.assertRaises(ValueError):
            to_roman(0)
        with self.assertRaises(ValueError):
            to_roman(4000)


if __name__ == "__main__":
    unittest.main()
