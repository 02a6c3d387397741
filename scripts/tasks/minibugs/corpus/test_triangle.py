import unittest

from triangle import triangle_kind


class TriangleTest(unittest.TestCase):
    def test_equilateral(self):
        self.assertEqual(triangle_kind(2, 2, 2), "equilateral")

    def test_isosceles(self):
        self.assertEqual(triangle_kind(3, 3, 5), "isosceles")
        self.assertEqual(triangle_kind(5, 3, 5), "isosceles")

    def test_scalene(self):
        self.assertEqual(triangle_kind(3, 4, 5), "scalene")

    def test_invalid(self):
        self.assertEqual(triangle_kind(1, 2, 3), "invalid")
        self.assertEqual(triangle_kind(0, 1, 1), "invalid")
        self.assertEqual(triangle_kind(1, 10, 2), "invalid")


if __name__ == "__main__":
    unittest.main()
