import unittest

from merge import merge_sorted


class MergeTest(unittest.TestCase):
    def test_interleaved(self):
        self.assertEqual(merge_sorted([1, 4, 6], [2, 3, 7]), [1, 2, 3, 4, 6, 7])

    def test_one_empty(self):
        self.assertEqual(merge_sorted([], [1, 2]), [1, 2])
        self.assertEqual(merge_sorted([1, 2], []), [1, 2])

    def test_ties(self):
        self.assertEqual(merge_sorted([1, 1], [1]), [1, 1, 1])

    def test_tail(self):
        self.assertEqual(merge_sorted([1, 2, 10, 11], [3]), [1, 2, 3, 10, 11])


if __name__ == "__main__":
    unittest.main()
