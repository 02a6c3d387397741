import unittest

from fibonacci import fib


class FibTest(unittest.TestCase):
    def test_start(self):
        self.assertEqual(fib(0), 0)
        self.assertEqual(fib(1), 1)
        self.assertEqual(fib(2), 1)

    def test_sequence(self):
        self.assertEqual([fib(n) for n in range(10)], [0, 1, 1, 2, 3, 5, 8, 13, 21, 34])

    def test_larger(self):
        self.assertEqual(fib(30), 832040)


if __name__ == "__main__":
    unittest.main()
