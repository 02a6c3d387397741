import unittest

from overlap import overlap


class OverlapTest(unittest.TestCase):
    def test_partial(self):
        self.assertEqual(overlap((1, 5), (3, 8)), 2)

    def test_inside(self):
        self.assertEqual(overlap((0, 10), (2, 4)), 2)

    def test_apart(self):
        self.assertEqual(overlap((0, 1), (5, 6)), 0)
        self.assertEqual(overlap((5, 6), (0, 1)), 0)

    def test_touching(self):
        self.assertEqual(overlap((0, 3), (3, 6)), 0)


if __name__ == "__main__":
    unittest.main()
