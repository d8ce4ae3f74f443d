"""Torch layers of the builtin engine."""
