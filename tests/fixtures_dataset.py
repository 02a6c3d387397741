"""Fixtures of the dataset tests."""
