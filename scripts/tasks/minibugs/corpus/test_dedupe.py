import unittest

from dedupe import dedupe


class DedupeTest(unittest.TestCase):
    def test_repeats(self):
        self.assertEqual(dedupe([3, 1, 3, 2, 1]), [3, 1, 2])

    def test_none(self):
        self.assertEqual(dedupe([1, 2, 3]), [1, 2, 3])

    def test_empty(self):
        self.assertEqual(dedupe([]), [])


if __name__ == "__main__":
    unittest.main()
