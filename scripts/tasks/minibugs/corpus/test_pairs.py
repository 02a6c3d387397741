import unittest

from pairs import count_pairs


class PairsTest(unittest.TestCase):
    def test_some(self):
        self.assertEqual(count_pairs([1, 2, 3, 4], 5), 2)

    def test_repeats(self):
        self.assertEqual(count_pairs([2, 2, 2], 4), 3)

    def test_none(self):
        self.assertEqual(count_pairs([1, 1], 5), 0)
        self.assertEqual(count_pairs([], 0), 0)

    def test_not_with_itself(self):
        self.assertEqual(count_pairs([3], 6), 0)


if __name__ == "__main__":
    unittest.main()
