"""Loader: hub checkpoints (per-expert keys, ≥ 5 files) and fused ones load on 4 gloo ranks bit-identically to
single-process transformers, each rank reading only its own slices; the hub is reached offline through a cache;
bad checkpoints fail loudly, naming the key and the file, before any tensor data is read."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from support.loader_checkpoints import ARCHS, BAD, COMMIT, EXPERT, REPO, _file_of
from xpar_zoo.testing import launch

WORLD = 4
IDS = torch.tensor([[3, 17, 99, 4, 64, 5, 120, 0], [8, 8, 42, 1, 2, 90, 33, 11]])

# (case, checkpoint, mesh, dtype, revision): every one is loaded in the same 4-rank job.
LOADS = [
    ("hub_fsdp", "hub", {}, None, None),
    ("hub_ep2", "hub", {"ep": 2}, None, None),
    ("hub_ep4", "hub", {"ep": 4}, None, None),
    ("hub_ep2_replicate2", "hub", {"ep": 2, "replicate": 2}, None, None),
    ("hub_ep2_bf16", "hub", {"ep": 2}, "bfloat16", None),
    ("fused_fsdp", "fused", {}, None, None),
    ("fused_ep2", "fused", {"ep": 2}, None, None),
    ("fused_ep4", "fused", {"ep": 4}, None, None),
    ("offline_hub_ep2", REPO, {"ep": 2}, None, None),
    ("offline_hub_commit_ep4", REPO, {"ep": 4}, None, COMMIT),
    # other architectures, by the same derived rules: Mixtral's block_sparse_moe.experts.{j}.w1/w3/w2 (a renaming
    # plus a fusion), with a vocabulary of 122 rows that FSDP2 shards unevenly (31, 31, 31, 29, padded);
    # DeepSeek-V3's shared experts, router correction-bias buffer and YaRN rotary buffers
    ("mixtral_hub_ep2", "mixtral", {"ep": 2}, None, None),
    ("deepseek_v3_hub_ep4", "deepseek_v3", {"ep": 4}, None, None),
    # tied embeddings: the hub file holds model.embed_tokens.weight only; lm_head shares it
    ("tied_hub_ep2", "tied", {"ep": 2}, None, None),
]


@pytest.fixture(scope="module")
def reference(checkpoints):
    """Single-process transformers ``from_pretrained`` of each hub checkpoint: ``{(checkpoint, dtype): (state dict,
    logits)}``."""
    from transformers import AutoModelForCausalLM

    out = {}
    for kind, dtype in [("hub", torch.float32), ("hub", torch.bfloat16), *((a, torch.float32) for a in ARCHS)]:
        model = AutoModelForCausalLM.from_pretrained(checkpoints[kind], dtype=dtype).eval()
        with torch.no_grad():
            logits = model(input_ids=IDS).logits
        out[kind, dtype] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, logits)
    return out


def _reference(reference, case):
    dtype = torch.bfloat16 if case.endswith("bf16") else torch.float32
    arch = next((a for a in ARCHS if case.startswith(a)), "hub")
    return dtype, *reference[arch, dtype]


# ---- the 4-rank job ---------------------------------------------------------------------------------------------------
class _CountingSafeOpen:
    """``safe_open`` that counts the bytes of every tensor it materialises (per rank)."""

    read: dict = {}

    def __init__(self, path, framework, device="cpu"):
        self._inner = safe_open(path, framework=framework, device=device)

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def _count(self, key, tensor):
        self.read[key] = self.read.get(key, 0) + tensor.numel() * tensor.element_size()
        return tensor

    def get_tensor(self, key):
        return self._count(key, self._inner.get_tensor(key))

    def get_slice(self, key):
        inner, outer = self._inner.get_slice(key), self

        class _Slice:
            def __getitem__(self, index):
                return outer._count(key, inner[index])

        return _Slice()


def _job(out_dir: str, dirs: dict, loads: list, bad: list) -> dict:
    import torch.distributed as dist

    import xpar_zoo.loader

    xpar_zoo.loader.safe_open = _CountingSafeOpen
    rank = dist.get_rank()
    results = {}
    for case, ckpt, mesh_kwargs, dtype, revision in loads:
        _CountingSafeOpen.read = {}
        model = xpar_zoo.from_pretrained(dirs.get(ckpt, ckpt), mesh=xpar_zoo.Mesh(**mesh_kwargs),
                                         dtype=dtype, revision=revision, progress=False)
        embed_rows = model.get_parameter("model.embed_tokens.weight").to_local().shape[0]  # sharded until a forward
        with torch.no_grad():
            logits = model(input_ids=IDS).logits.float()
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (dict(_CountingSafeOpen.read), model._xpar_load.bytes_read, logits.tolist(),
                                       embed_rows))
        state = xpar_zoo.full_state_dict(model)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, f"{out_dir}/{case}.safetensors")
            save_file({"logits": logits}, f"{out_dir}/{case}.logits.safetensors")
            results[case] = {
                "read": [e[0] for e in every], "stats_bytes": [e[1] for e in every],
                "ranks_agree": all(e[2] == every[0][2] for e in every), "embed_rows": [e[3] for e in every],
                "classes": [c.__name__ for c in type(model).__mro__], "training": model.training,
                "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            }
    for kind in bad:
        _CountingSafeOpen.read = {}
        name = dirs.get(kind, "org/not-in-the-cache")
        try:
            xpar_zoo.from_pretrained(name, mesh=xpar_zoo.Mesh(ep=2), progress=False)
            outcome = ("no error", "", False)
        except Exception as e:  # noqa: BLE001 — the test inspects the type
            outcome = (type(e).__name__, str(e), isinstance(e, xpar_zoo.XparError))
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (outcome, sum(_CountingSafeOpen.read.values())))
        if rank == 0:
            results[kind] = {"outcome": outcome, "same_on_all_ranks": all(o == outcome for o, _ in every),
                             "bytes_read": [b for _, b in every]}
    return results


@pytest.fixture(scope="module")
def results(checkpoints):
    dirs = {k: str(v) for k, v in checkpoints.items() if isinstance(v, Path)}
    with pytest.MonkeyPatch.context() as mp:  # the spawned ranks inherit this environment
        mp.setenv("HF_HUB_CACHE", str(checkpoints["cache"]))
        mp.setenv("HF_HUB_OFFLINE", "1")
        return launch.run(_job, WORLD, str(checkpoints["root"]), dirs, LOADS, BAD, timeout_s=240)



# ---- parity ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [c[0] for c in LOADS])
def test_full_state_dict_is_bit_identical_to_transformers(results, reference, checkpoints, case):
    dtype, ref_state, _ = _reference(reference, case)
    got = load_file(checkpoints["root"] / f"{case}.safetensors")
    assert set(got) == set(ref_state)
    if case.startswith("tied"):
        index = json.loads((checkpoints["tied"] / "model.safetensors.index.json").read_text())
        assert "lm_head.weight" not in index["weight_map"]
        assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    if case.startswith("deepseek"):
        assert any("correction_bias" in k for k in got)  # a persistent buffer, loaded like a parameter
    different = [k for k in ref_state if got[k].dtype != ref_state[k].dtype or not torch.equal(got[k], ref_state[k])]
    assert not different, f"{case}: differs from transformers.from_pretrained in {different}"
    cls = {"mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}.get(case.rsplit("_hub", 1)[0],
                                                                                       "Qwen3MoeForCausalLM")
    assert cls in results[case]["classes"] and results[case]["training"] is False
    assert results[case]["dtypes"] == [str(dtype)]


@pytest.mark.parametrize("case", [c[0] for c in LOADS])
def test_logits_match_single_process_transformers(results, reference, checkpoints, case):
    dtype, _, ref_logits = _reference(reference, case)
    got = load_file(checkpoints["root"] / f"{case}.logits.safetensors")["logits"]
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, ref_logits.float(), rtol=tol, atol=tol)
    assert results[case]["ranks_agree"]


# ---- each rank reads only its own slices ------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["hub_fsdp", "hub_ep2", "hub_ep4", "fused_ep2", "fused_ep4"])
def test_each_rank_reads_a_quarter_of_the_checkpoint(results, checkpoints, case):
    total, state = checkpoints["total"], checkpoints["state"]
    small = sum(v.numel() * v.element_size() for v in state.values() if v.dim() == 1)  # norms: split unevenly
    per_rank = [sum(r.values()) for r in results[case]["read"]]
    assert per_rank == results[case]["stats_bytes"]  # the loader's own count agrees with the instrumented one
    assert max(per_rank) <= total / WORLD + small, f"{case}: per-rank bytes {per_rank} of {total}"
    assert sum(per_rank) == total  # no replication: every byte is read exactly once, by one rank


def _experts_read(read: dict, proj: str | None = None) -> set[int]:
    return {int(k.split(".experts.")[1].split(".")[0]) for k in read if ".experts." in k and (proj is None or proj in k)}


def test_ep4_ranks_read_only_their_own_experts(results):
    for rank, read in enumerate(results["hub_ep4"]["read"]):  # 8 experts, ep=4: rank r owns experts 2r, 2r+1
        assert _experts_read(read) == {2 * rank, 2 * rank + 1}


def test_ep2_ranks_read_only_their_quarter_of_the_experts(results):
    # ranks [[0, 1], [2, 3]] = [ep_fsdp, ep]: ep rank r % 2 holds experts 4·(r % 2) … +3, which FSDP splits on dim 0
    # over the ep_fsdp ranks: rank r keeps 2 of them, gate and up
    # (tests/distributed/test_fsdp_placement.py reads dim-1 shards)
    for rank, read in enumerate(results["hub_ep2"]["read"]):
        first = 4 * (rank % 2) + 2 * (rank // 2)
        own = {first, first + 1}
        assert _experts_read(read) == _experts_read(read, "gate_proj") == _experts_read(read, "up_proj") == own


def test_uneven_fsdp_shards_read_only_their_rows(results, checkpoints):
    assert results["mixtral_hub_ep2"]["embed_rows"] == [31, 31, 31, 29]  # 122 vocab rows, FSDP2 chunks (padded)
    read = [r["model.embed_tokens.weight"] for r in results["mixtral_hub_ep2"]["read"]]
    assert read == [rows * 32 * 4 for rows in (31, 31, 31, 29)]  # [rows, H=32] fp32: each rank its own rows


def test_hsdp_replicas_each_read_their_half(results, checkpoints):
    per_rank = [sum(r.values()) for r in results["hub_ep2_replicate2"]["read"]]
    assert sum(per_rank) == 2 * checkpoints["total"]  # two replicas, each reads the checkpoint once in total
    assert max(per_rank) <= checkpoints["total"] / 2 + 1024


# ---- strictness -------------------------------------------------------------------------------------------------------
def _outcome(results, kind):
    row = results[kind]
    assert row["same_on_all_ranks"], f"{kind}: ranks disagree"
    assert row["bytes_read"] == [0] * WORLD, f"{kind}: tensor data was read before the error: {row['bytes_read']}"
    name, message, is_xpar = row["outcome"]
    assert is_xpar, f"{kind}: {name}: {message}"
    return name, message


def test_missing_expert_key_is_named(results, checkpoints):
    name, message = _outcome(results, "missing_expert")
    assert name == "CheckpointMismatchError"
    assert "missing" in message and "model.layers.1.mlp.experts.3.up_proj.weight" in message
    assert "model.layers.1.mlp.experts.gate_up_proj" in message


def test_unexpected_key_is_named_with_its_file(results, checkpoints):
    name, message = _outcome(results, "unexpected_key")
    file = _file_of(checkpoints["unexpected_key"], "model.layers.0.self_attn.extra_proj.weight")
    assert name == "CheckpointMismatchError" and "unexpected" in message
    assert f"model.layers.0.self_attn.extra_proj.weight ({file})" in message


def test_wrong_shape_is_named_with_file_and_shapes(results, checkpoints):
    name, message = _outcome(results, "wrong_shape")
    file = _file_of(checkpoints["wrong_shape"], "model.norm.weight")
    assert name == "CheckpointMismatchError"
    assert f"model.norm.weight ({file}): shape [31]" in message and "[32]" in message


def test_wrong_expert_shape_is_named_with_file(results, checkpoints):
    name, message = _outcome(results, "wrong_expert_shape")
    file = _file_of(checkpoints["wrong_expert_shape"], f"{EXPERT}.2.down_proj.weight")
    assert name == "CheckpointMismatchError"
    assert f"{EXPERT}.2.down_proj.weight ({file})" in message and "[32, 15]" in message


def test_offline_unknown_repo_is_a_clear_error(results):
    name, message = _outcome(results, "offline_unknown_repo")
    assert name == "HubResolutionError" and "org/not-in-the-cache" in message and "HF_HUB_OFFLINE" in message
