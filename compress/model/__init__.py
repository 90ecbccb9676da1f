"""Models: loading (lazily, layer by layer), the layer walk's helpers, calibration windows, resume, MoE."""
