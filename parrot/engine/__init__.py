"""Engines: the universal Fill / Generate / FreeContext interface and the builtin PyTorch engine."""
