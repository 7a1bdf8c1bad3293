"""Ranks given different settings are told so at start, in one line naming the setting and the ranks, on every
rank, before anything loads (issue 31, item 4): different --steps no longer hang until the process-group timeout,
different --lr train no more, different data files (the same name, other contents) are caught by the data
fingerprint. One 2-rank launched run."""

import json
import os

import pytest

from xpar_zoo.testing import launch, parity


def _job(base) -> list:
    """Every rank: three runs, each with one setting differing by rank; each rank's error messages."""
    import torch.distributed as dist

    from xpar_zoo.errors import TrainConfigError
    from xpar_zoo.train import TrainConfig, train

    rank = dist.get_rank()
    cases = {"steps": dict(steps=4 + rank), "lr": dict(lr=1e-3 * (rank + 1)),
             "data": dict(data=str(base / f"data{rank}" / "train.jsonl")),
             "fingerprint": dict(model=str(base / "model"), data="train.jsonl")}  # relative: each rank's own file
    messages = {}
    for name, differing in cases.items():
        if name == "fingerprint":
            os.chdir(base / f"data{rank}")
        settings = dict(model=str(base / "no-model"), data=str(base / "data0" / "train.jsonl"),
                        output=str(base / f"out-{name}"), steps=4, seq_len=8, progress=False, tensorboard=False)
        settings.update(differing)
        try:
            train(TrainConfig(**settings))
            messages[name] = None
        except TrainConfigError as e:
            messages[name] = str(e)
        except Exception as e:  # noqa: BLE001 - reported to the test
            messages[name] = f"{type(e).__name__}: {e}"
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, messages)
    return gathered


@pytest.fixture(scope="module")
def messages(tmp_path_factory):
    base = tmp_path_factory.mktemp("agree")
    for rank in range(2):
        (base / f"data{rank}").mkdir()
        ids = list(range(1 + rank, 21 + rank))  # pre-tokenized: no tokenizer needed
        (base / f"data{rank}" / "train.jsonl").write_text(json.dumps({"input_ids": ids}) + "\n")
    parity.build_model(parity.tiny_config("qwen3_moe")).save_pretrained(base / "model")
    return launch.run(_job, 2, base, timeout_s=300)


def test_different_steps_are_named_with_their_ranks_instead_of_hanging(messages):
    expect = ("ranks were given different settings: steps: 4 on rank 0; 5 on rank 1 (give every rank the same "
              "flags and files)")
    assert [m["steps"] for m in messages] == [expect, expect]


def test_different_lr_is_named_on_every_rank(messages):
    assert all(m["lr"].startswith("ranks were given different settings: lr: 0.001 on rank 0; 0.002 on rank 1")
               for m in messages)


def test_different_data_paths_are_named(messages):
    assert all("data: " in m["data"] and "data0/train.jsonl on rank 0" in m["data"] for m in messages)


def test_same_data_path_with_other_contents_is_caught_by_the_fingerprint(messages):
    """Each rank reads its own `train.jsonl` (as on nodes whose files differ): the same setting, other tokens."""
    assert all(m["fingerprint"].startswith("ranks were given different settings: data_fingerprint: ")
               and "on rank 0;" in m["fingerprint"] and "on rank 1 (" in m["fingerprint"] for m in messages), messages
