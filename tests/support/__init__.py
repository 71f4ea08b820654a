"""Helpers shared by the tests: fixture paths, the transformers parity check, subprocess runners."""
