"""Ground floor: errors, paths, typed config, memory, text data, staging, signals, locks (no torch model code)."""
