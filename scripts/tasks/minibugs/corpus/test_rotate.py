import unittest

from rotate import rotate


class RotateTest(unittest.TestCase):
    def test_right(self):
        self.assertEqual(rotate([1, 2, 3, 4, 5], 2), [4, 5, 1, 2, 3])

    def test_left(self):
        self.assertEqual(rotate([1, 2, 3, 4, 5], -1), [2, 3, 4, 5, 1])

    def test_full_turn(self):
        self.assertEqual(rotate([1, 2, 3], 3), [1, 2, 3])
        self.assertEqual(rotate([1, 2, 3], 0), [1, 2, 3])

    def test_empty(self):
        self.assertEqual(rotate([], 4), [])


if __name__ == "__main__":
    unittest.main()
