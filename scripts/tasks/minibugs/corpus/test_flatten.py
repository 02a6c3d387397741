import unittest

from flatten import flatten


class FlattenTest(unittest.TestCase):
    def test_flat(self):
        self.assertEqual(flatten([1, 2, 3]), [1, 2, 3])

    def test_nested(self):
        self.assertEqual(flatten([1, [2, [3, [4]]], 5]), [1, 2, 3, 4, 5])

    def test_empty_lists(self):
        self.assertEqual(flatten([[], [[]], 1]), [1])


if __name__ == "__main__":
    unittest.main()
