"""Number grids (integer, FP4, KV-cache, N:M masks): the arithmetic every stage and format shares."""
