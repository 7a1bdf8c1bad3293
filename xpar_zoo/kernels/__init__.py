"""Triton kernels (GPU; on CPU only under ``TRITON_INTERPRET=1``): the fused experts and the vocab-parallel
cross-entropy."""
