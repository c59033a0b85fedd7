"""Benchmarks: scripts that print a table and write JSON under results/bench/ (run as ``python bench/NAME.py``)."""
