"""No silent wrong results on a parallelized model (4 gloo ranks, fp32): the loss is the global-batch mean however
the valid targets are split (gradient accumulation through ``num_items_in_batch`` included); trainable parameters
that ``parallelize`` does not manage are refused at the next forward; a model built on meta is materialized before
it loads a checkpoint, or refused; greedy ``generate`` equals single-process transformers' under every plan.

The parity tests (test_core, test_vocab, test_zoo) train on labels whose valid-target counts differ per rank, one
rank holding none (``parity.make_labels``); this file covers what one step of those does not."""

import functools
import subprocess
import sys
import textwrap

import pytest
import torch

from xpar_zoo.testing import parity

WORLD = 4
MICRO = 2  # micro-batches per rank and optimizer step
ACCUMULATION_MESHES = {
    "fsdp": ({}, {}),
    "ep2": ({"ep": 2}, {}),
    "ep2_transformers_loss": ({"ep": 2}, {"fused_loss": False}),
    "ep2_emb2_head2": ({"ep": 2, "emb": 2, "head": 2}, {}),
    "ep2_replicate2": ({"ep": 2, "replicate": 2}, {}),
}


def _accumulation(cfg, data, labels) -> dict:
    """Per mesh: MICRO micro-batches per rank with ``num_items_in_batch`` = every valid target of the step, one
    SGD(lr=1) step; against single-process transformers on the whole step's batch at once."""
    import torch.distributed as dist

    import xpar_zoo
    from xpar_zoo.loss.global_batch import count_targets

    rank = dist.get_rank()
    n_items = int(count_targets(labels))  # every valid target of every rank and micro-batch of the step
    out = {}
    for name, (mesh_kwargs, kwargs) in ACCUMULATION_MESHES.items():
        model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(**mesh_kwargs), **kwargs)
        total = torch.zeros(())
        for m in range(MICRO):
            loss = model(input_ids=data[m, rank], labels=labels[m, rank], num_items_in_batch=n_items).loss
            loss.backward()
            total += loss.detach()
        torch.optim.SGD(model.parameters(), lr=1.0).step()
        dist.all_reduce(total)
        params = xpar_zoo.full_state_dict(model)
        if rank == 0:
            out[name] = {"loss": total.item() / WORLD, "params": params}
    if rank == 0:
        ref = parity.build_model(cfg, experts_implementation="eager")
        before = {k: v.clone() for k, v in ref.state_dict().items()}
        seq = data.shape[-1]
        loss = ref(input_ids=data.reshape(-1, seq), labels=labels.reshape(-1, seq)).loss
        loss.backward()
        torch.optim.SGD(ref.parameters(), lr=1.0).step()
        after = {k: v.detach() for k, v in ref.state_dict().items()}
        for row in out.values():
            row["ref_loss"] = loss.item()
            row["errors"] = parity.param_errors(row.pop("params"), after, before)
    return out


def _unmanaged(cfg, ids) -> dict:
    """The error a forward raises after a trainable parameter was added to / swapped into a parallelized model."""
    import xpar_zoo

    out = {}
    for how in ("added", "swapped", "added_frozen"):
        model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(ep=2))
        if how.startswith("added"):  # what peft.get_peft_model does to a parallelized model
            extra = torch.nn.Parameter(torch.zeros(4, cfg.hidden_size), requires_grad=how == "added")
            model.model.layers[1].self_attn.q_proj.register_parameter("lora_A", extra)
        else:
            model.model.norm.weight = torch.nn.Parameter(torch.ones(cfg.hidden_size))
        try:
            model(input_ids=ids, labels=ids).loss.backward()
            out[how] = None
        except xpar_zoo.XparError as e:
            out[how] = f"{type(e).__name__}: {e}"
    return out


def _checked_after_steps(cfg, ids) -> dict:
    """How many times the readiness check walks the model over three steps, and the error a forward raises after a
    change made once those steps passed: a trainable parameter added or swapped in, a frozen one added and unfrozen."""
    import importlib

    import xpar_zoo

    par = importlib.import_module("xpar_zoo.parallelize")  # the module (xpar_zoo.parallelize is also the function)
    walks = []
    walk = par.check_materialized

    def counted(model, *args, **kwargs):
        walks.append(1)
        return walk(model, *args, **kwargs)

    out = {}
    par.check_materialized = counted
    try:
        for how in ("added", "swapped", "unfrozen"):
            model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(ep=2))
            walks.clear()
            for _ in range(3):
                model(input_ids=ids, labels=ids).loss.backward()
            out["walks in 3 steps"] = len(walks)
            attn = model.model.layers[1].self_attn.q_proj
            if how == "added":
                attn.register_parameter("lora_A", torch.nn.Parameter(torch.zeros(4, cfg.hidden_size)))
            elif how == "swapped":
                model.model.norm.weight = torch.nn.Parameter(torch.ones(cfg.hidden_size))
            else:
                attn.register_parameter("lora_A", torch.nn.Parameter(torch.zeros(4, cfg.hidden_size), False))
                model(input_ids=ids, labels=ids).loss.backward()  # frozen: trains nothing, no error
                attn.lora_A.requires_grad_(True)
            try:
                model(input_ids=ids, labels=ids).loss.backward()
                out[how] = None
            except xpar_zoo.XparError as e:
                out[how] = f"{type(e).__name__}: {e}"
    finally:
        par.check_materialized = walk
    return out


def _meta_recipe(cfg, ids, labels, root: str) -> dict:
    """Build on meta, parallelize, materialize, load a DCP checkpoint: the forward equals the saved model's. And the
    ways of getting it wrong: loading into the meta model, or after a plain to_empty."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import xpar_zoo

    rank = dist.get_rank()
    mesh = xpar_zoo.Mesh(ep=2)
    saved = xpar_zoo.parallelize(parity.build_model(cfg), mesh)
    xpar_zoo.save_checkpoint(root, saved)
    with torch.no_grad():
        expected = saved(input_ids=ids[rank], labels=labels[rank]).loss

    def on_meta():
        with torch.device("meta"):
            return xpar_zoo.parallelize(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), mesh)

    out = {}
    model = on_meta()
    xpar_zoo.materialize(model)
    xpar_zoo.load_checkpoint(root, model)
    with torch.no_grad():
        got = model(input_ids=ids[rank], labels=labels[rank]).loss
    out["difference"] = (got - expected).abs().item()
    for how, prepare in [("meta", lambda m: None), ("to_empty", lambda m: m.to_empty(device="cpu"))]:
        model = on_meta()
        prepare(model)
        for call, fn in [("load", functools.partial(xpar_zoo.load_checkpoint, root, model)),
                         ("forward", functools.partial(model, input_ids=ids[rank], labels=labels[rank]))]:
            try:
                fn()
                out[how, call] = None
            except xpar_zoo.XparError as e:
                out[how, call] = f"{type(e).__name__}: {e}"
    return out


def _generate(prompts) -> dict:
    """Greedy generation of each rank's own prompt on several meshes against single-process transformers."""
    import torch.distributed as dist

    import xpar_zoo

    rank = dist.get_rank()
    cfg = parity.tiny_config("qwen3_moe")
    out = {}
    for name, mesh_kwargs in [("ep2", {"ep": 2}), ("ep2_emb2_head2", {"ep": 2, "emb": 2, "head": 2}),
                              ("head4", {"head": 4})]:
        model = xpar_zoo.parallelize(parity.build_model(cfg).eval(), xpar_zoo.Mesh(**mesh_kwargs))
        # rank 3 stops early (fewer new tokens): the ranks must stay in step while the others go on
        new = 6 if rank < 3 else 2
        tokens = model.generate(prompts[rank:rank + 1], max_new_tokens=new, do_sample=False)
        out[name] = [None] * WORLD
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, tokens[0].tolist())
        out[name] = gathered
    if rank == 0:
        ref = parity.build_model(cfg, experts_implementation="eager").eval()
        out["reference"] = [ref.generate(prompts[r:r + 1], max_new_tokens=6 if r < 3 else 2,
                                         do_sample=False)[0].tolist() for r in range(WORLD)]
    return out


def _save_pretrained(cfg, data, root: str) -> dict:
    """One SGD step on Mesh(ep=2, emb=2, head=2), then ``model.save_pretrained`` (all ranks) twice into the same
    directory, the second time over a stale shard: what plain transformers loads back, against the live model."""
    from pathlib import Path

    import torch.distributed as dist

    import xpar_zoo

    rank = dist.get_rank()
    model = xpar_zoo.parallelize(parity.build_model(cfg), xpar_zoo.Mesh(ep=2, emb=2, head=2))
    ids = data[0, rank]
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    out_dir = Path(root) / "saved"
    model.save_pretrained(out_dir, max_shard_size="40KB")
    if rank == 0:
        (out_dir / "model-00099-of-00099.safetensors").write_bytes(b"stale")
    model.save_pretrained(out_dir, max_shard_size="40KB")
    live = xpar_zoo.full_state_dict(model)
    if rank != 0:
        return {}
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).state_dict()
    keys = set()
    for f in out_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as handle:
            keys |= set(handle.keys())
    parity.build_model(cfg).save_pretrained(Path(root) / "reference")
    ref_keys = set()
    for f in (Path(root) / "reference").glob("*.safetensors"):
        with safe_open(str(f), "pt") as handle:
            ref_keys |= set(handle.keys())
    return {"equal": sorted(n for n in live if torch.equal(live[n], loaded[n])), "names": sorted(live),
            "keys_as_transformers": keys == ref_keys, "files": sorted(p.name for p in out_dir.iterdir())}


def _job(root: str) -> dict:
    cfg = parity.tiny_config("qwen3_moe")
    data = parity.make_batches(cfg.vocab_size, MICRO, WORLD, seed=11)
    labels = parity.make_labels(data)
    ids = parity.make_batches(cfg.vocab_size, 1, WORLD, seed=12)[0]
    return {"accumulation": _accumulation(cfg, data, labels),
            "unmanaged": _unmanaged(cfg, ids[0]),
            "checked": _checked_after_steps(cfg, ids[0]),
            "meta": _meta_recipe(cfg, ids, parity.make_labels(ids[None])[0], root),
            "generate": _generate(parity.make_batches(cfg.vocab_size, 1, WORLD, batch=1, seq=5, seed=13)[0, :, 0]),
            "save_pretrained": _save_pretrained(cfg, data, root)}


def zoo_job(tmp_path_factory) -> tuple:
    """This module's job in the zoo's one 4-rank run (``zoo_proofs`` in tests/conftest.py), which runs beside the
    other tests."""
    return _job, (str(tmp_path_factory.mktemp("meta_ckpt")),)


@pytest.fixture(scope="module")
def results(zoo_proofs):
    return zoo_proofs[__name__]


@pytest.mark.parametrize("mesh", list(ACCUMULATION_MESHES))
def test_accumulated_micro_batches_with_num_items_equal_one_global_batch(results, mesh):
    row = results["accumulation"][mesh]
    parity.assert_losses_match([row["loss"]], [row["ref_loss"]], what=f"{mesh}, {MICRO} micro-batches")
    parity.assert_params_match(row["errors"], what=f"{mesh}, {MICRO} accumulated micro-batches, one SGD step:")


def test_a_parameter_added_or_swapped_in_after_parallelize_is_refused_at_the_next_forward(results):
    row = results["unmanaged"]
    assert row["added"] and "ModelStateError" in row["added"], row
    assert "model.layers.1.self_attn.q_proj.lora_A" in row["added"] and "before parallelize" in row["added"]
    assert row["swapped"] and "model.norm.weight" in row["swapped"], row
    assert row["added_frozen"] is None, "a frozen parameter trains nothing: no error"


def test_the_readiness_check_walks_the_model_once_and_again_after_a_change(results):
    row = results["checked"]
    assert row["walks in 3 steps"] == 1, row
    for how, name in (("added", "q_proj.lora_A"), ("swapped", "model.norm.weight"), ("unfrozen", "q_proj.lora_A")):
        assert row[how] and row[how].startswith("ModelStateError") and name in row[how], (how, row[how])


def test_a_meta_model_materialized_and_loaded_runs_like_the_saved_one(results):
    assert results["meta"]["difference"] < 1e-6


@pytest.mark.parametrize("how", ["meta", "to_empty"])
@pytest.mark.parametrize("call", ["load", "forward"])
def test_loading_or_running_a_model_not_materialized_is_a_clear_error(results, how, call):
    message = results["meta"][how, call]
    assert message is not None, f"{call} after {how} went through silently"
    assert "xpar_zoo.materialize(model)" in message, message
    if how == "to_empty":
        assert "inv_freq" in message, message


@pytest.mark.parametrize("mesh", ["ep2", "ep2_emb2_head2", "head4"])
def test_greedy_generate_equals_single_process(results, mesh):
    assert results["generate"][mesh] == results["generate"]["reference"]


def _run_alone(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=300)


def test_from_pretrained_in_a_plain_process_runs_as_world_1(tmp_path):
    """No process group, no launcher: the first thing people try. ``torch_dtype`` as transformers takes it."""
    parity.build_model(parity.tiny_config("qwen3_moe")).save_pretrained(tmp_path / "hub")
    done = _run_alone(f"""
        import warnings, torch, torch.distributed as dist, xpar_zoo
        from xpar_zoo.testing import parity
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = xpar_zoo.from_pretrained({str(tmp_path / "hub")!r}, torch_dtype=torch.float32, progress=False)
        assert any("torch_dtype" in str(w.message) and w.category is FutureWarning for w in caught)
        assert dist.get_world_size() == 1
        ids = torch.arange(16).view(2, 8)
        ref = parity.build_model(parity.tiny_config("qwen3_moe"), experts_implementation="eager")
        diff = (model(input_ids=ids, labels=ids).loss - ref(input_ids=ids, labels=ids).loss).abs().item()
        assert diff < 1e-5, diff
        try:
            xpar_zoo.from_pretrained({str(tmp_path / "hub")!r}, dtyp=torch.float32)
        except TypeError as e:
            assert "dtyp" in str(e) and "dtype" in str(e), e
        else:
            raise AssertionError("an unknown keyword argument went through")
        print("OK")
    """)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


def test_a_launched_process_without_init_process_group_is_refused():
    done = _run_alone("""
        import os, xpar_zoo
        os.environ["WORLD_SIZE"] = "4"
        try:
            xpar_zoo.Mesh()
        except xpar_zoo.MeshError as e:
            assert "WORLD_SIZE=4" in str(e) and "init_process_group" in str(e), e
            print("OK")
    """)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


def test_save_pretrained_on_every_rank_writes_what_plain_transformers_loads(results):
    row = results["save_pretrained"]
    assert row["equal"] == row["names"], f"differ: {sorted(set(row['names']) - set(row['equal']))}"
    assert row["keys_as_transformers"], "the hub keys differ from transformers' own save_pretrained"
    assert "model-00099-of-00099.safetensors" not in row["files"], "a stale shard of an earlier save was left"
    assert not [f for f in row["files"] if f.startswith(".")], row["files"]
