import unittest

from search import binary_search


class BinarySearchTest(unittest.TestCase):
    def test_found(self):
        values = [1, 3, 5, 7, 9, 11]
        for i, v in enumerate(values):
            self.assertEqual(binary_search(values, v), i)

    def test_missing(self):
        self.assertEqual(binary_search([1, 3, 5], 4), -1)
        self.assertEqual(binary_search([1, 3, 5], 0), -1)
        self.assertEqual(binary_search([1, 3, 5], 6), -1)

    def test_empty(self):
        self.assertEqual(binary_search([], 1), -1)

    def test_single(self):
        self.assertEqual(binary_search([4], 4), 0)


if __name__ == "__main__":
    unittest.main()
