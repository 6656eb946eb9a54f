"""Benchmarks: scripts that measure tamis and write JSON under benchmarks/results/ (see benchmarks/README.md)."""
