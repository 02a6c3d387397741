import unittest

from rle import rle_encode


class RleTest(unittest.TestCase):
    def test_empty(self):
        self.assertEqual(rle_encode(""), "")

    def test_runs(self):
        self.assertEqual(rle_encode("aaabcc"), "a3b1c2")

    def test_single(self):
        self.assertEqual(rle_encode("z"), "z1")

    def test_no_runs(self):
        self.assertEqual(rle_encode("abc"), "a1b1c1")


if __name__ == "__main__":
    unittest.main()
