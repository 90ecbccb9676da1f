"""Compression beneath every entry point: stages in memory, streaming saves, model-free chains."""
