"""Checkpoints against attackers and careless users, in one process (issue 18): the crafted payload is real; optimizer
groups must match; side files are read before the model is touched; links and renamed steps are never checkpoints; NaN /
inf are refused or named; user dicts that look like the JSON codec's tags come back as themselves; the next save removes
what interrupted ones left."""

import os
import pickle
import re
import shutil
import warnings

import pytest
import torch

import xpar_zoo
from xpar_zoo.checkpoint import CheckpointWarning
from xpar_zoo.errors import CheckpointError, NonFiniteError

EXPERTS = "model.layers.0.mlp.experts"


from support.integrity_checkpoints import _model, _payload, _recommit, _snapshot, _train_step, _unchanged


def test_the_payload_is_real(tmp_path):
    """Unpickled without restriction, the payload creates its file (so the next test proves something)."""
    probe = tmp_path / "probe"
    pickle.loads(_payload(f"touch {probe}"))
    assert probe.exists()



# ---- 5. optimizer parameter groups ------------------------------------------------------------------------------
def _groups(model, how: str):
    if how == "one":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    matrices = [p for p in model.parameters() if p.ndim > 1]
    others = [p for p in model.parameters() if p.ndim <= 1]
    if how == "two":
        return torch.optim.AdamW([{"params": matrices}, {"params": others, "weight_decay": 0.0}], lr=1e-2)
    first = [p for n, p in model.named_parameters() if "experts" in n]  # "regrouped": same count, other members
    return torch.optim.AdamW([{"params": first}, {"params": [p for n, p in model.named_parameters()
                                                             if "experts" not in n], "lr": 1e-3}], lr=1e-2)


@pytest.mark.parametrize("saved_as, loaded_as, message", [
    ("one", "two", "the checkpoint's optimizer has 1 parameter group, this optimizer has 2"),
    ("two", "one", "the checkpoint's optimizer has 2 parameter groups, this optimizer has 1"),
    ("two", "regrouped", "parameter group 0 holds"),
])
def test_optimizer_parameter_groups_must_match(saved_as, loaded_as, message, tmp_path):
    model = _model()
    opt = _groups(model, saved_as)
    _train_step(model, opt)
    path = xpar_zoo.save_checkpoint(tmp_path, model, opt)
    fresh = _model(seed=3)
    before = _snapshot(fresh)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        xpar_zoo.load_checkpoint(path, fresh, _groups(fresh, loaded_as))
    assert _unchanged(fresh, before)
    same = _groups(fresh, saved_as)
    xpar_zoo.load_checkpoint(path, fresh, same)  # the same grouping loads
    assert [len(g["params"]) for g in same.param_groups] == [len(g["params"]) for g in opt.param_groups]


# ---- 7. side files before the model -----------------------------------------------------------------------------
@pytest.mark.parametrize("file", ["extra_state.json", "rng/rank-00000.safetensors", "xpar_checkpoint.json"])
def test_a_garbled_side_file_is_found_before_the_model_is_touched(file, saved):
    path = saved / file
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _recommit(saved)  # garbled when written: checksums agree, the content is wrong
    model = _model(seed=3)
    before = _snapshot(model)
    with pytest.raises(CheckpointError, match=re.escape(file)):
        xpar_zoo.load_checkpoint(saved, model)
    assert _unchanged(model, before)


# ---- 8. links and renamed steps ---------------------------------------------------------------------------------
def test_links_and_renamed_steps_are_never_checkpoints(tmp_path):
    model = _model()
    other = xpar_zoo.save_checkpoint(tmp_path / "other", model, step=30)
    root = tmp_path / "root"
    xpar_zoo.save_checkpoint(root, model, extra_state={"step": 1})
    (root / "step-00000090").symlink_to(other, target_is_directory=True)  # another root's checkpoint
    shutil.copytree(root / "step-00000001", root / "step-00000070")  # a copy under another step's name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert xpar_zoo.latest_checkpoint(root) == root / "step-00000001"
    said = " ".join(str(w.message) for w in caught)
    assert "step-00000090: a symbolic link" in said and "step-00000070: COMPLETE records step 1" in said
    with pytest.warns(CheckpointWarning):
        assert xpar_zoo.load_checkpoint(root, _model(seed=3)) == {"step": 1}
    xpar_zoo.save_checkpoint(root, model, extra_state={"step": 2}, keep_last=1)
    assert sorted(os.listdir(root)) == ["step-00000002", "step-00000070", "step-00000090"]  # neither is pruned
    assert (root / "step-00000090").is_symlink() and xpar_zoo.latest_checkpoint(tmp_path / "other") == other


# ---- 9. non-finite values ---------------------------------------------------------------------------------------
def test_non_finite_parameters_are_refused_at_save_and_named_at_load(tmp_path):
    model = _model()
    with torch.no_grad():
        model.get_parameter(f"{EXPERTS}.gate_up_proj")[1, 0, 0] = float("nan")
        model.get_parameter("lm_head.weight")[0, 0] = float("inf")
    with pytest.raises(CheckpointError, match=r"non-finite values \(NaN or inf\) in "
                                              rf"{re.escape(EXPERTS)}\.gate_up_proj, lm_head\.weight; pass "
                                              r"allow_nonfinite=True"):
        xpar_zoo.save_checkpoint(tmp_path / "root", model)
    assert not (tmp_path / "root").exists(), "nothing may be written"
    path = xpar_zoo.save_checkpoint(tmp_path / "root", model, allow_nonfinite=True)
    assert xpar_zoo.load_checkpoint(path, _model(seed=3)) == {}
    with pytest.raises(CheckpointError, match=rf"non-finite values \(NaN or inf\) in {re.escape(EXPERTS)}"
                                              r"\.gate_up_proj, lm_head\.weight"):
        xpar_zoo.load_checkpoint(path, _model(seed=3), check_finite=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_clip_grad_norm_error_if_nonfinite_follows_torch_and_names_the_parameters(bad):
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    model.get_parameter(f"{EXPERTS}.down_proj").grad[2, 0, 0] = bad
    params = [p for p in model.parameters() if p.grad is not None]
    reference = []  # the same gradients on plain tensors, for torch's own clip_grad_norm_
    for p in params:
        reference.append(torch.nn.Parameter(torch.zeros_like(p)))
        reference[-1].grad = p.grad.clone()
    with pytest.raises(RuntimeError, match="non-finite"):  # torch's flag and exception type
        torch.nn.utils.clip_grad_norm_(reference, 1.0, error_if_nonfinite=True)
    with pytest.raises(NonFiniteError, match=rf"non-finite gradients in {re.escape(EXPERTS)}\.down_proj; set "
                                             "error_if_nonfinite=False") as e:
        xpar_zoo.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
    assert isinstance(e.value, RuntimeError)
    for p, r in zip(params, reference):  # no gradient changed before the error
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0, equal_nan=True)
    want = torch.nn.utils.clip_grad_norm_(reference, 1.0)  # without the flag: scaled by the non-finite norm
    got = xpar_zoo.clip_grad_norm_(model, 1.0)
    assert not torch.isfinite(want) and bool(got.isnan()) == bool(want.isnan())
    for p, r in zip(params, reference):
        torch.testing.assert_close(p.grad, r.grad, equal_nan=True)


# ---- 10. the JSON codec's tags ----------------------------------------------------------------------------------
def test_user_dicts_that_look_like_tags_come_back_as_themselves(tmp_path):
    extra = {"step": 3, "a": {"__tuple__": [1, 2]}, "b": {"__dict__": {"x": (1, 2)}}, "c": (1, (2, {"__tuple__": []})),
             "d": [{"__dict__": 0}], "e": {"__tuple__": [1], "other": 2}}
    model = _model()
    xpar_zoo.save_checkpoint(tmp_path, model, extra_state=extra)
    assert xpar_zoo.load_checkpoint(tmp_path, model) == extra


# ---- leftovers, a full disk ----------------------------------------------------------------------------------------
def test_the_next_save_removes_what_interrupted_saves_left(tmp_path):
    model = _model()
    xpar_zoo.save_checkpoint(tmp_path, model, step=1)
    (tmp_path / ".tmp-step-00000002-0123456789ab").mkdir()
    (tmp_path / ".tmp-step-00000002-0123456789ab" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / ".deleting-step-00000000-01234567").mkdir()
    with pytest.warns(CheckpointWarning, match=r"removed \.deleting-step-00000000-01234567, "
                                               r"\.tmp-step-00000002-0123456789ab from .*interrupted saves"):
        xpar_zoo.save_checkpoint(tmp_path, model, step=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000001", "step-00000002"]
