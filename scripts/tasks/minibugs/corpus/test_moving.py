import unittest

from moving import moving_average


class MovingAverageTest(unittest.TestCase):
    def test_pairs(self):
        self.assertEqual(moving_average([1, 3, 5, 7], 2), [2.0, 4.0, 6.0])

    def test_triples(self):
        self.assertEqual(moving_average([3, 3, 6, 9, 0], 3), [4.0, 6.0, 5.0])

    def test_window_too_long(self):
        self.assertEqual(moving_average([1, 2], 3), [])

    def test_bad_window(self):
        with self.assertRaises(ValueError):
            moving_average([1], 0)


if __name__ == "__main__":
    unittest.main()
