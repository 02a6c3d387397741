"""Fixtures of the capture tests."""
