"""The Triton experts kernels compile for the H200 (sm_90a) with wgmma instructions and no register spills (the compile
script, run as a user would)."""

import pytest

pytest.importorskip("triton")  # conftest.py sets TRITON_INTERPRET=1: the kernels run on the CPU

# Triton's interpreter converts 1-element arrays to scalars, which NumPy deprecates (and 2.4 refuses: hence the pin).
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")



def test_kernels_compile_for_the_h200_with_wgmma_and_no_spills():
    """The real (not interpreted) kernels, compiled for sm_90 as one training step's launches specialise them."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "compile_sm90.py")
    out = subprocess.run([sys.executable, script, "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert {r["kernel"] for r in rows} == {"_rows_gemm", "_k_gemm", "_gather_sum", "_combine_backward",
                                           "_row_stats", "_softmax_grad"}
    # every specialisation one training step launches: the fused path (both backward variants), the EP path, and
    # the fused loss's two chunk kernels
    assert len(rows) == 18
    for r in rows:
        assert r["spill_bytes"] == 0, r
        assert r["shared_bytes"] <= 227 * 1024, r
        if r["kernel"].endswith("gemm"):
            assert r["wgmma"], r
            # ~100-140 registers a thread at 8 warps; a jump toward the 255 cap means an epilogue keeps a tile too
            # many alive (storing the recomputed activation after the gradients did: 250), one step from spilling
            assert r["registers"] <= 192, r
