import unittest

from bits import count_bits


class BitsTest(unittest.TestCase):
    def test_small(self):
        self.assertEqual([count_bits(n) for n in range(8)], [0, 1, 1, 2, 1, 2, 2, 3])

    def test_power(self):
        self.assertEqual(count_bits(1024), 1)

    def test_all_ones(self):
        self.assertEqual(count_bits(255), 8)

    def test_negative(self):
        with self.assertRaises(ValueError):
            count_bits(-1)


if __name__ == "__main__":
    unittest.main()
