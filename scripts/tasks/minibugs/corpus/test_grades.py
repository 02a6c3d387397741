import unittest

from grades import letter_grade


class GradeTest(unittest.TestCase):
    def test_bounds(self):
        self.assertEqual(letter_grade(90), "A")
        self.assertEqual(letter_grade(89), "B")
        self.assertEqual(letter_grade(80), "B")
        self.assertEqual(letter_grade(70), "C")
        self.assertEqual(letter_grade(60), "D")
        self.assertEqual(letter_grade(59), "F")

    def test_extremes(self):
        self.assertEqual(letter_grade(100), "A")
        self.assertEqual(letter_grade(0), "F")

    def test_out_of_range(self):
        with self.assertRaises(ValueError):
            letter_grade(101)
        with self.assertRaises(ValueError):
            letter_grade(-1)


if __name__ == "__main__":
    unittest.main()
