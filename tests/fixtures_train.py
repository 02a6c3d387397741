"""Fixtures of the train tests."""
