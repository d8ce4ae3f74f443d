"""Benchmarks: the request-centric baseline client, the paper's apps as data, and their runners."""
