"""Forward styles that parallelize installs on a transformers model (here: the long-context ``sequence`` style)."""
