"""Forward styles that ``parallelize`` installs: per extra plan experts (EP dispatch over fused ``[E, H, I]``
tensors), vocab (``emb`` / ``head``), gathered (weights all-gathered before use); and sequence (long context: sp/cp
attention and the split of full-length rows)."""
