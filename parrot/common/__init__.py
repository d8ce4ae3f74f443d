"""Shared plain types of Parrot (no torch): typed errors, sampling parameters, perf criteria."""
