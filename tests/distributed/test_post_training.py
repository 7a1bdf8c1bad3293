"""Post-training (issue 40) on 4 gloo ranks, one launch for every case: ``xpar_zoo.iter_hub_weights`` on
``Mesh(ep=2, emb=2, head=2)`` yields exactly the names and bytes ``xpar-zoo convert to-hf`` writes (plain, LoRA
merged, the adapter alone in PEFT's files) on every rank, with a per-rank peak of one bucket plus one hub tensor,
never a whole fused experts tensor."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import xpar_zoo
from xpar_zoo.testing import launch, parity

peft = pytest.importorskip("peft")  # an optional extra: requirements-test.txt installs it

WORLD = 4
FULL_MESH = {"ep": 2, "emb": 2, "head": 2}
SMALL_BUCKET = 4096  # bytes: smaller than a fused experts tensor, larger than one expert's slice of it


def _config(**overrides):
    return parity.tiny_config("qwen3_moe", vocab_size=64, **overrides)


def _files(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _differ(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose name, dtype, shape or bytes differ between the two."""
    def raw(t):
        return t.contiguous().view(-1).view(torch.uint8)

    return sorted(k for k in set(got) | set(want) if k not in got or k not in want or got[k].dtype != want[k].dtype
                  or got[k].shape != want[k].shape or not torch.equal(raw(got[k]), raw(want[k])))


def _streamed(model, **kwargs) -> dict[str, torch.Tensor]:
    return {k: v.clone() for bucket in xpar_zoo.iter_hub_weights(model, **kwargs) for k, v in bucket}


def _weights(root: Path) -> dict:
    """Every rank: the stream of a trained model, a LoRA model (merged) and its adapter against the files
    ``convert to-hf`` / ``save_adapter`` write; rank 0's result holds every rank's."""
    from support.lora_setup import lora_config
    from xpar_zoo.converters.export import export_to_hf

    rank = dist.get_rank()
    cfg = _config()
    model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(**FULL_MESH))
    ids = parity.make_batches(cfg.vocab_size, 1, WORLD, seed=4)[0, rank]
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    torch.manual_seed(3)
    lora = xpar_zoo.from_pretrained(str(root / "base"), xpar_zoo.Mesh(**FULL_MESH), peft_config=lora_config(),
                                    progress=False)
    xpar_zoo.save_checkpoint(root / "ckpt", model)
    xpar_zoo.save_checkpoint(root / "lora_ckpt", lora)
    xpar_zoo.save_adapter(lora, root / "adapter")
    if rank == 0:
        export_to_hf(root / "ckpt", root / "hf", progress=False, max_shard_size="40KB")
        export_to_hf(root / "lora_ckpt", root / "lora_hf", progress=False, merge_adapter=True)
    dist.barrier()
    hub, merged, adapter = _files(root / "hf"), _files(root / "lora_hf"), _files(root / "adapter")
    row = {"small": _differ(_streamed(model, bucket_bytes=SMALL_BUCKET), hub),
           "one_bucket": _differ(_streamed(model, bucket_bytes="1MiB", dtype="bf16"),
                                 {k: v.to(torch.bfloat16) for k, v in hub.items()}),
           "merged": _differ(_streamed(lora, bucket_bytes=SMALL_BUCKET), merged),
           "adapter": _differ(_streamed(lora, adapter_only=True), adapter),
           "keys": len(hub),
           "peak": parity.live_peak_bytes(
               lambda: [None for _ in xpar_zoo.iter_hub_weights(model, bucket_bytes=SMALL_BUCKET)],
               str(root / f"trace{rank}.json")),
           "full_state_dict_peak": parity.live_peak_bytes(lambda: xpar_zoo.full_state_dict(model),
                                                          str(root / f"full{rank}.json")),
           "largest_hub_tensor": max(t.numel() * t.element_size() for t in hub.values()),
           "fused": model.model.layers[0].mlp.experts.gate_up_proj.numel() * 4}
    rows = [None] * WORLD
    dist.all_gather_object(rows, row)
    return rows


def _job(root: str) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/support on the ranks
    root = Path(root)
    if dist.get_rank() == 0:
        parity.build_model(_config()).save_pretrained(root / "base")
    dist.barrier()
    return {"weights": _weights(root)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch.run(_job, WORLD, str(tmp_path_factory.mktemp("post_training")))


@pytest.mark.parametrize("case", ["small", "one_bucket", "merged", "adapter"])
def test_streamed_hub_weights_are_the_bytes_convert_to_hf_writes_on_every_rank(results, case):
    for rank, row in enumerate(results["weights"]):
        assert row["keys"] > 20
        assert row[case] == [], f"rank {rank}, {case}: differ {row[case][:6]}"


def test_streaming_peak_is_one_bucket_plus_one_hub_tensor_never_a_fused_tensor(results):
    for rank, row in enumerate(results["weights"]):
        assert 0 < row["peak"] <= SMALL_BUCKET + row["largest_hub_tensor"], (rank, row["peak"])
        assert row["peak"] < row["fused"], (rank, row["peak"], row["fused"])
    assert results["weights"][0]["full_state_dict_peak"] > 4 * results["weights"][0]["peak"]
