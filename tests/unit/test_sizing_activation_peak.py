"""The sizer's activation peak against the measured peak of live tensor bytes of one forward+backward, in one
process (sp = cp = 1), fp32, with the fused whole-vocab head as ``parallelize`` gives it: what autograd keeps
(:func:`~xpar_zoo.sizing.activation_bytes`) plus what the fused head (:func:`~xpar_zoo.sizing.fused_loss_temporaries`)
and eager attention's backward (:func:`~xpar_zoo.sizing.attention_temporaries`) hold only while they run.

Measured with the torch profiler's allocator accounting (:func:`xpar_zoo.testing.parity.live_peak_bytes`: the peak
of live CPU tensor bytes above those live at the start, parameters excluded). sdpa: 0.99–1.01× the measured peak;
eager (its ``seq²`` scores, kept and in backward): 1.07–1.11×, an upper bound, since the layers after the last
attention have freed their values when its backward runs. Bound: sdpa within ±10 %, eager from 0.95× to 1.2×."""

import pytest
import torch

from xpar_zoo import sizing
from xpar_zoo.testing import parity

DIMS = dict(hidden_size=256, moe_intermediate_size=128, vocab_size=2048, num_attention_heads=8,
            num_key_value_heads=2, head_dim=32, num_hidden_layers=2)
BOUNDS = {"sdpa": (0.9, 1.1), "eager": (0.95, 1.2)}


@pytest.mark.parametrize("attention,rows,seq", [("sdpa", 2, 1024), ("eager", 1, 1024),
                                                ("eager", 1, 2048)])
def test_activation_estimate_is_within_the_stated_bounds_of_the_measured_peak(tmp_path, attention, rows, seq):
    import xpar_zoo.styles.experts  # noqa: F401  (the experts implementation the parallel model uses)
    from xpar_zoo.styles.vocab import install_fused_loss

    cfg = parity.tiny_config("qwen3_moe", **DIMS)
    cfg._attn_implementation = attention
    model = parity.build_model(cfg, experts_implementation="xpar_zoo")
    assert model.config._attn_implementation == attention
    install_fused_loss(model)
    ids = torch.randint(0, cfg.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: lazily made buffers (rotary caches) are not activations
    got = parity.live_peak_bytes(step, str(tmp_path / "trace.json"))
    tokens = ids.numel()
    want = (sizing.activation_bytes(cfg, tokens, 4, fused_head=1, qk_norm=True, seq=seq, attention=attention)
            + sizing.fused_loss_temporaries(cfg, tokens, 1, 4)
            + sizing.attention_temporaries(cfg, tokens, 4, seq=seq, attention=attention))
    low, high = BOUNDS[attention]
    assert low * got <= want <= high * got, f"sizer {want / 2**20:.1f} MiB, measured peak {got / 2**20:.1f} MiB"
