"""One decision, one place: ``choose_inner_attention`` picks the sp/cp attention's inner path from the
implementation, the device, what the mask is, the sizes and the options; the attention wrapper takes the path it
returns (tests/distributed/test_long_context.py records the paths taken) and the sizer sizes it."""

from __future__ import annotations

import pytest
import torch

from xpar_zoo import sizing
from xpar_zoo.parallel.options import ParallelOptions
from xpar_zoo.styles.sequence_layout import token_layout
from xpar_zoo.styles.sequence_masks import SequenceForward
from xpar_zoo.styles.sequence_paths import (
    AttentionSizes,
    InnerPath,
    MaskKind,
    block_rows,
    choose_inner_attention,
)
from xpar_zoo.testing import parity

SMALL = AttentionSizes(rows=1, heads=4, queries=256, keys=1024, dtype_bytes=4)  # a mask of 1.5 MiB
LARGE = AttentionSizes(rows=1, heads=4, queries=2048, keys=8192, dtype_bytes=4)  # a mask of 96 MiB
DEFAULT = ParallelOptions()
IN_ORDER, CAUSAL, MASKED = MaskKind.CAUSAL_IN_ORDER, MaskKind.CAUSAL, MaskKind.MASKED


@pytest.mark.parametrize("implementation, device, mask, sizes, options, want", [
    # flex and flash make their own masks from the global indices, whatever the rows
    ("flex_attention", "cuda", MASKED, LARGE, DEFAULT, InnerPath.FLEX),
    ("flash_attention_2", "cuda", CAUSAL, SMALL, DEFAULT, InnerPath.FLASH),
    ("flash_attention_3", "cpu", MASKED, LARGE, DEFAULT, InnerPath.FLASH),
    # sdpa on plain causal rows in row order: its own causal kernel, no mask
    ("sdpa", "cpu", IN_ORDER, LARGE, DEFAULT, InnerPath.SDPA_CAUSAL),
    # cp's plain causal rows: lower-right on CUDA and the CPU, the mask elsewhere, unless the options say otherwise
    ("sdpa", "cuda", CAUSAL, LARGE, DEFAULT, InnerPath.LOWER_RIGHT),
    ("sdpa", "cpu", CAUSAL, SMALL, DEFAULT, InnerPath.LOWER_RIGHT),
    ("sdpa", "cpu", CAUSAL, LARGE, DEFAULT, InnerPath.LOWER_RIGHT),
    ("sdpa", "mps", CAUSAL, SMALL, DEFAULT, InnerPath.WHOLE_MASK),
    ("sdpa", "cpu", CAUSAL, SMALL, ParallelOptions(cp_attention="dense"), InnerPath.WHOLE_MASK),
    ("sdpa", "cpu", CAUSAL, LARGE, ParallelOptions(cp_attention="dense"), InnerPath.BLOCKED),
    ("sdpa", "cuda", CAUSAL, SMALL, ParallelOptions(cp_attention="dense"), InnerPath.WHOLE_MASK),
    # packed documents, padding or a short window: the mask, whole where it fits the device's budget
    ("sdpa", "cuda", MASKED, LARGE, DEFAULT, InnerPath.WHOLE_MASK),  # 96 MiB within a GPU's 256
    ("sdpa", "cpu", MASKED, LARGE, DEFAULT, InnerPath.BLOCKED),  # beyond the CPU's 16
    ("sdpa", "cpu", MASKED, LARGE, ParallelOptions(attention_block_mib=128), InnerPath.WHOLE_MASK),
    # eager always takes the mask; its scores count against the budget too
    ("eager", "cpu", IN_ORDER, SMALL, DEFAULT, InnerPath.BLOCKED),  # 1.5 MiB of mask, 17.5 with the scores
    ("eager", "cuda", CAUSAL, SMALL, DEFAULT, InnerPath.WHOLE_MASK),
    ("eager", "cpu", CAUSAL, SMALL, ParallelOptions(attention_block_mib=32), InnerPath.WHOLE_MASK),
])
def test_the_inner_path_is_a_function_of_its_inputs(implementation, device, mask, sizes, options, want):
    assert choose_inner_attention(implementation, device, mask, sizes, options) is want


def test_sinks_keep_cp_off_the_lower_right_path():
    assert choose_inner_attention("sdpa", "cuda", CAUSAL, SMALL, DEFAULT, sinks=True) is InnerPath.WHOLE_MASK


def test_a_blocked_path_has_the_blocks_the_budget_allows():
    assert block_rows("sdpa", "cpu", SMALL, DEFAULT) is None
    assert block_rows("sdpa", "cpu", LARGE, DEFAULT) == 16 * 2 ** 20 // (8192 * 6)
    assert block_rows("sdpa", "cpu", LARGE, ParallelOptions(attention_block_mib=1)) == 2 ** 20 // (8192 * 6)


def test_the_mask_kind_of_a_forward():
    sp_only, cp = token_layout(16, 2, 1, 0, 0), token_layout(16, 1, 2, 0, 1)
    plain = SequenceForward(sp_only.queries, sp_only.keys, None, None)
    assert plain.mask_kind(True, None, 16) is IN_ORDER
    assert plain.mask_kind(True, 16, 16) is IN_ORDER  # a window as long as the row masks nothing
    assert plain.mask_kind(True, 4, 16) is MASKED
    assert plain.mask_kind(False, None, 16) is MASKED
    assert SequenceForward(cp.queries, cp.keys, None, None).mask_kind(True, None, 16) is CAUSAL
    docs = torch.tensor([[0] * 8 + [1] * 8])
    assert SequenceForward(cp.queries, cp.keys, docs, None).mask_kind(True, None, 16) is MASKED
    padded = torch.ones(1, 16, dtype=torch.bool)
    padded[0, -2:] = False
    assert SequenceForward(sp_only.queries, sp_only.keys, None, padded).mask_kind(True, None, 16) is MASKED


def test_the_sizer_sizes_the_path_the_wrapper_would_take():
    """The sizer asks the same function (a GPU's paths on plain rows): sdpa under cp keeps no mask by default; told
    ``cp_attention="dense"`` it sizes the mask the wrapper then builds; eager's mask and scores go where the block
    budget sends them."""
    cfg = parity.tiny_config("qwen3_moe", hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                             moe_intermediate_size=64, vocab_size=512, num_hidden_layers=3)
    seq, cp = 1024, 4

    def terms(attention, options):
        return sizing.activation_terms(cfg, seq, 4, seq=seq, cp=cp, attention=attention, options=options)

    sizes = AttentionSizes(1, 8, seq // cp, seq, 4)
    assert choose_inner_attention("sdpa", "cuda", CAUSAL, sizes, DEFAULT) is InnerPath.LOWER_RIGHT
    assert terms("sdpa", DEFAULT)["attention mask"] == 0
    dense = ParallelOptions(cp_attention="dense")
    assert choose_inner_attention("sdpa", "cuda", CAUSAL, sizes, dense) is InnerPath.WHOLE_MASK
    assert terms("sdpa", dense)["attention mask"] == seq // cp * seq * 4
    tiny = ParallelOptions(attention_block_mib=0.01)
    assert choose_inner_attention("eager", "cuda", CAUSAL, sizes, tiny) is InnerPath.BLOCKED
    assert terms("eager", tiny)["attention mask"] == terms("eager", tiny)["attention scores"] == 0
    wide = ParallelOptions(attention_block_mib=1000)
    assert choose_inner_attention("eager", "cuda", CAUSAL, sizes, wide) is InnerPath.WHOLE_MASK
    assert terms("eager", wide)["attention mask"] == seq // cp * seq * 4 and terms("eager", wide)["attention scores"]
