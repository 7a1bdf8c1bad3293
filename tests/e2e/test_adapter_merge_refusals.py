"""`xpar-zoo convert to-hf --merge-adapter` refuses, in one line and before writing anything, a checkpoint whose
PEFT record disagrees with its adapter tensors (a recorded rank r other than the tensors': PEFT's scaling
lora_alpha / r would merge a wrongly scaled update) or is hostile (wrong types, huge or non-finite numbers, another
peft_type, custom classes, module lists that are not names). The checkpoint is a world-1 LoRA model's; each case
rewrites its record (and the checksum the checkpoint keeps of it, as a hostile writer would)."""

import json
import shutil

import pytest

pytest.importorskip("peft")
from peft import LoraConfig  # noqa: E402

import xpar_zoo  # noqa: E402
from xpar_zoo.commands import cli  # noqa: E402
from xpar_zoo.io.integrity import file_checksum  # noqa: E402
from xpar_zoo.testing import parity  # noqa: E402

STEP = "step-00000001"


@pytest.fixture(scope="module")
def peft_checkpoint(tmp_path_factory):
    base = tmp_path_factory.mktemp("merge")
    parity.build_model(parity.tiny_config("qwen3_moe")).save_pretrained(base / "hub")
    model = xpar_zoo.from_pretrained(str(base / "hub"), progress=False, peft_config=LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj"]))
    xpar_zoo.save_checkpoint(base / "ckpt", model, step=1)
    return base / "ckpt"


def _rewritten(peft_checkpoint, tmp_path, change):
    root = tmp_path / "ckpt"
    shutil.copytree(peft_checkpoint, root)
    step = root / STEP
    meta = json.loads((step / "xpar_checkpoint.json").read_text())
    change(meta["peft"])
    (step / "xpar_checkpoint.json").write_text(json.dumps(meta))
    record = json.loads((step / "COMPLETE").read_text())
    record["files"]["xpar_checkpoint.json"] = (step / "xpar_checkpoint.json").stat().st_size
    record["checksums"]["xpar_checkpoint.json"] = file_checksum(step / "xpar_checkpoint.json")
    (step / "COMPLETE").write_text(json.dumps(record))
    return root


def _merge(root, out, capsys):
    rc = cli.main(["convert", "to-hf", str(root), str(out), "--merge-adapter"])
    return rc, capsys.readouterr().err


def test_merge_of_an_untouched_record_writes_the_export(peft_checkpoint, tmp_path, capsys):
    root = _rewritten(peft_checkpoint, tmp_path, lambda peft: None)
    rc, err = _merge(root, tmp_path / "out", capsys)
    assert rc == 0, err
    assert (tmp_path / "out" / "config.json").is_file()


@pytest.mark.parametrize("key, value", [("r", 16), ("r", 1), ("rank_pattern", {"q_proj": 8})])
def test_merge_refuses_a_rank_that_disagrees_with_the_tensors(peft_checkpoint, tmp_path, capsys, key, value):
    root = _rewritten(peft_checkpoint, tmp_path, lambda peft: peft["default"].update({key: value}))
    rc, err = _merge(root, tmp_path / "out", capsys)
    assert rc == 2 and "the adapter tensors disagree with the adapter record" in err, err
    assert "lora_A.default.weight" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change, said", [
    ({"r": "4"}, 'r = "4"; the LoRA rank is a whole number'),
    ({"r": -4}, "r = -4;"),
    ({"r": 10 ** 30}, "r = 1000000000000000000000000000000;"),
    ({"r": True}, "r = true;"),
    ({"lora_alpha": float("nan")}, "lora_alpha = NaN; it scales the update"),
    ({"lora_alpha": float("inf")}, "lora_alpha = Infinity;"),
    ({"lora_alpha": 1e308}, "lora_alpha = 1e+308;"),
    ({"lora_alpha": "8"}, 'lora_alpha = "8";'),
    ({"alpha_pattern": {"q_proj": float("nan")}}, "alpha_pattern = "),
    ({"peft_type": "EVIL"}, "peft_type \"EVIL\"; xpar_zoo takes LoRA adapters"),
    ({"peft_type": "PREFIX_TUNING"}, "peft_type \"PREFIX_TUNING\""),
    ({"peft_type": 3}, "peft_type 3;"),
    ({"target_modules": 5}, "target_modules = 5; a module name or a list of names"),
    ({"target_modules": ["nope_proj"], "target_parameters": None}, "PEFT cannot apply the record"),
    ({"lora_dropout": "x"}, 'lora_dropout = "x"; a probability'),
    ({"use_dora": "yes"}, 'use_dora = "yes"; true or false'),
    ({"base_model_name_or_path": 7}, "base_model_name_or_path = 7;"),
    ({"auto_mapping": {"base_model_class": "Evil", "parent_library": "os"}}, "auto_mapping names custom model"),
    ([1, 2], "an adapter record is a JSON object, got list"),
])
def test_merge_refuses_a_hostile_peft_record_in_one_line(peft_checkpoint, tmp_path, capsys, change, said):
    def edit(peft):
        if isinstance(change, dict):
            peft["default"].update(change)
        else:
            peft["default"] = change
    root = _rewritten(peft_checkpoint, tmp_path, edit)
    rc, err = _merge(root, tmp_path / "out", capsys)
    assert rc == 2 and said in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_merge_refuses_two_adapter_records(peft_checkpoint, tmp_path, capsys):
    root = _rewritten(peft_checkpoint, tmp_path, lambda peft: peft.update(other=dict(peft["default"])))
    rc, err = _merge(root, tmp_path / "out", capsys)
    assert rc == 2 and "holds 2 adapter records (default, other); xpar_zoo merges one" in err, err
