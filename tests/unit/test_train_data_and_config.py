"""``xpar-zoo train``'s parts in one process: packing (positions restart per document, first targets masked, no
attention across documents), each rank's distinct rows, the router aux loss of one rank, data formats and their errors,
a config file then flags."""

import itertools

import pytest
import torch

from xpar_zoo.loss.balance import global_router_aux_loss
from xpar_zoo.loss.global_batch import IGNORE_INDEX
from xpar_zoo.testing import parity
from xpar_zoo.train import config_from_args, read_config_file
from xpar_zoo.train.config import add_arguments, parse_mesh
from xpar_zoo.train.data import (
    PackedCorpus,
    flatten_rows,
    micro_batches,
    read_documents,
)


# ---- data and packing -------------------------------------------------------------------------------------------
def test_packing_restarts_positions_per_document_and_masks_their_first_targets():
    lengths = [3, 5, 4, 6]
    tokens = torch.arange(sum(lengths)).numpy()
    corpus = PackedCorpus(tokens, torch.tensor(lengths).numpy(), seq_len=4, seed=0)
    assert corpus.rows_per_epoch == 4
    epoch = corpus.rows(0, 4)
    stream = epoch["input_ids"].reshape(-1).tolist()
    docs = [list(range(s, s + n)) for s, n in zip([0, 3, 8, 12], lengths)]
    tilings = [sum((docs[i] for i in order), [])[:16] for order in itertools.permutations(range(4))]
    assert stream in tilings  # the documents in a shuffled order, cut into rows (the 2-token tail dropped)
    starts = {0, 3, 8, 12}
    for ids, pos, labels in zip(epoch["input_ids"], epoch["position_ids"], epoch["labels"]):
        ids, pos, labels = ids.tolist(), pos.tolist(), labels.tolist()
        for j, (t, p, lab) in enumerate(zip(ids, pos, labels)):
            same_doc = j > 0 and t == ids[j - 1] + 1 and t not in starts
            assert p == (pos[j - 1] + 1 if same_doc else 0)  # 0 at every document start and at the row start
            assert lab == (t if p else IGNORE_INDEX)
    again = PackedCorpus(tokens, torch.tensor(lengths).numpy(), seq_len=4, seed=0)
    assert torch.equal(again.rows(0, 8)["input_ids"], corpus.rows(0, 8)["input_ids"])  # deterministic in the seed
    other = PackedCorpus(tokens, torch.tensor(lengths).numpy(), seq_len=4, seed=1)
    assert not torch.equal(other.rows(0, 4)["input_ids"], epoch["input_ids"])
    assert not torch.equal(corpus.rows(4, 4)["input_ids"], epoch["input_ids"])  # epoch 1 is reshuffled


def test_ranks_read_distinct_rows_that_cover_the_step():
    corpus = PackedCorpus(torch.arange(400).numpy(), torch.full((20,), 20).numpy(), seq_len=5, seed=3)
    world, micro, accum = 4, 2, 3
    seen = [tuple(row.tolist()) for r in range(world)
            for batch in micro_batches(corpus, 8, r, world, micro, accum) for row in batch["input_ids"]]
    expect = [tuple(row.tolist()) for row in corpus.rows(8, world * micro * accum)["input_ids"]]
    assert len(set(seen)) == len(seen) == world * micro * accum and sorted(seen) == sorted(expect)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_documents_do_not_attend_across_boundaries(attn):
    cfg = parity.tiny_config("qwen3_moe")
    cfg._attn_implementation = attn
    model = parity.build_model(cfg, experts_implementation="eager")
    a, b = torch.randint(0, 128, (1, 5)), torch.randint(0, 128, (1, 7))
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        logits = model(input_ids=packed, position_ids=pos, use_cache=False).logits
        apart = torch.cat([model(input_ids=x, use_cache=False).logits for x in (a, b)], dim=1)
        unmasked = model(input_ids=packed, use_cache=False).logits
    assert (logits - apart).abs().max() < 1e-5
    assert (unmasked[:, 5:] - apart[:, 5:]).abs().max() > 1e-2  # without restarting positions they would mix
    batch = {"input_ids": torch.stack([packed[0], packed[0].flip(0)]), "position_ids": torch.cat([pos, pos])}
    batch["labels"] = batch["input_ids"].masked_fill(batch["position_ids"] == 0, IGNORE_INDEX)
    with torch.no_grad():  # one flattened row (for flash attention's varlen path) is the same batch
        assert abs(model(**batch, use_cache=False).loss - model(**flatten_rows(batch), use_cache=False).loss) < 1e-6


def test_router_aux_loss_of_one_rank_is_transformers_own():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        load_balancing_loss_func,
    )

    logits = tuple(torch.randn(12, 8, requires_grad=True) for _ in range(3))
    share, local = global_router_aux_loss(logits, 8, 2)
    want = load_balancing_loss_func(logits, 8, 2)
    assert torch.allclose(share, want) and torch.allclose(local, want)
    g1 = torch.autograd.grad(share, logits)
    g2 = torch.autograd.grad(want, logits)
    assert all(torch.allclose(a, b) for a, b in zip(g1, g2))


def test_data_formats_and_errors(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\n\nsecond doc\n")
    assert read_documents(tmp_path / "a.txt").texts == ["first doc", "second doc"]
    (tmp_path / "ids.jsonl").write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4]}\n')
    assert read_documents(tmp_path / "ids.jsonl").token_ids == [[1, 2, 3], [4]]
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["x y", "z"]}), tmp_path / "d.parquet")
    assert read_documents(tmp_path / "d.parquet").texts == ["x y", "z"]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    from xpar_zoo.errors import DataError

    with pytest.raises(DataError, match=r"bad.jsonl:2: no 'text' field \(fields: body\)"):
        read_documents(tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match="fewer than one row"):
        PackedCorpus(torch.arange(3).numpy(), torch.tensor([3]).numpy(), seq_len=8, seed=0)


# ---- configuration and the command line -------------------------------------------------------------------------
def _parse(argv):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_config_file_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: m\ndata: d.jsonl\noutput: out\nsteps: 10\nseq-len: 64\nmesh: {ep: 2, replicate: 2}\n"
                    "lr: 1e-4\nrecompute: true\n")
    cfg = _parse(["--config", str(path), "--lr", "3e-4", "--mesh", "ep=4,emb=2"])
    assert (cfg.model, cfg.steps, cfg.seq_len, cfg.lr, cfg.recompute) == ("m", 10, 64, 3e-4, True)
    assert cfg.mesh == {"ep": 4, "emb": 2}
    assert read_config_file(path)["mesh"] == {"ep": 2, "replicate": 2}
    assert parse_mesh("ep=2, emb=2,replicate=2") == {"ep": 2, "emb": 2, "replicate": 2}
