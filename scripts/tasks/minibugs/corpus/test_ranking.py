import unittest

from ranking import second_largest


class SecondLargestTest(unittest.TestCase):
    def test_plain(self):
        self.assertEqual(second_largest([3, 9, 4, 7]), 7)

    def test_duplicates(self):
        self.assertEqual(second_largest([5, 5, 4]), 4)

    def test_too_few(self):
        self.assertIsNone(second_largest([2, 2]))
        self.assertIsNone(second_largest([]))

    def test_descending(self):
        self.assertEqual(second_largest([10, 8, 6]), 8)


if __name__ == "__main__":
    unittest.main()
