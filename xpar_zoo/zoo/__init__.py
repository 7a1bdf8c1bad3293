"""The zoo: which architectures xpar_zoo trains, and their configs read safely (nothing from a model directory runs)."""
