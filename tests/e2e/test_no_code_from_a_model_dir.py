"""Nothing from a model directory runs. A `config.json` with an `auto_map` pointing at Python files beside it
(each would write a marker file when imported): with a model_type transformers does not know, every command
(`size`, `train`, `convert inspect`, `convert to-dcp`, `convert to-hf --model`, `publish`, Python
`from_pretrained`) exits 2 with one line saying what xpar_zoo trains and why; with one it knows, the custom code is
ignored with one line and the command works. No command prompts (stdin closed), the marker never appears. All
commands run in one process started for the module."""

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from xpar_zoo.testing import parity

MARKER_CODE = "import pathlib\npathlib.Path({marker!r}).write_text('custom code ran')\n"

SCRIPT = textwrap.dedent("""
    import contextlib, io, json, sys, traceback
    from xpar_zoo.commands import cli
    import xpar_zoo

    results = {}
    for case, argv in json.loads(sys.argv[1]).items():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if argv[0] == "from_pretrained":
                    xpar_zoo.from_pretrained(argv[1], progress=False)
                    rc = 0
                else:
                    rc = cli.main(argv)
            except xpar_zoo.XparError as e:
                print(f"{type(e).__name__}: {e}", file=sys.stderr)
                rc = 2
            except BaseException as e:
                traceback.print_exc()
                rc = f"raised {type(e).__name__}"
        results[case] = {"rc": rc, "out": out.getvalue(), "err": err.getvalue()}
    print(json.dumps(results))
""")


def _model_dir(path, model_type, marker):
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                                   "AutoModelForCausalLM": "modeling_custom.CustomModel"})
    (path / "config.json").write_text(json.dumps(config))
    for module in ("configuration_custom", "modeling_custom"):
        (path / f"{module}.py").write_text(MARKER_CODE.format(marker=str(marker)))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every command on a custom-code directory (unknown model_type) and on one of a known model_type; rank 0's
    results and the marker path."""
    base = tmp_path_factory.mktemp("remote_code")
    marker = base / "MARKER"
    custom = _model_dir(base / "custom", "custom_moe", marker)
    known = _model_dir(base / "known", "qwen3_moe", marker)
    plain = base / "plain"
    shutil.copytree(known, plain)
    (plain / "config.json").write_text(json.dumps(
        {k: v for k, v in json.loads((known / "config.json").read_text()).items() if k != "auto_map"}))
    data = base / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(1, 40))}) + "\n" for _ in range(8)))
    cases = {}
    for kind, d in (("custom", custom), ("known", known)):
        cases.update({
            f"{kind}_size": ["size", str(d), "--world", "2"],
            f"{kind}_inspect": ["convert", "inspect", str(d)],
            f"{kind}_to_dcp": ["convert", "to-dcp", str(d), str(base / f"{kind}_dcp")],
            f"{kind}_from_pretrained": ["from_pretrained", str(d)],
        })
    cases["plain_to_dcp"] = ["convert", "to-dcp", str(plain), str(base / "plain_dcp")]
    for kind, d in (("custom", custom), ("known", known)):
        cases[f"{kind}_to_hf_model"] = ["convert", "to-hf", str(base / "plain_dcp"), str(base / f"{kind}_hf"),
                                        "--model", str(d)]
        cases[f"{kind}_publish"] = ["publish", str(d), "me/custom", "--dry-run"]
    cases["custom_train"] = ["train", "--model", str(custom), "--data", str(data), "--steps", "1", "--seq-len", "8",
                             "--output", str(base / "run"), "--no-tensorboard"]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=600, cwd=base)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return results, marker, proc.stderr


WHY = "xpar_zoo never runs code from a model directory"


@pytest.mark.parametrize("command", ["size", "inspect", "to_dcp", "to_hf_model", "train", "from_pretrained"])
def test_custom_code_dir_is_refused_in_one_line_without_a_prompt(runs, command):
    results, marker, _ = runs
    r = results[f"custom_{command}"]
    assert r["rc"] == 2, r
    lines = [line for line in r["err"].splitlines() if WHY in line]
    assert len(lines) == 1 and "auto_map" in lines[0] and "transformers' own classes" in lines[0], r["err"]
    assert "Traceback" not in r["err"] and "[y/N]" not in r["out"] + r["err"]
    assert not marker.exists()


def test_custom_code_dir_is_refused_by_publish(runs):
    results, marker, _ = runs
    r = results["custom_publish"]
    assert r["rc"] == 2 and "names custom code (auto_map), which publish does not upload" in r["err"], r
    assert not marker.exists()


@pytest.mark.parametrize("command", ["size", "inspect", "to_dcp", "to_hf_model", "from_pretrained"])
def test_known_model_type_with_auto_map_runs_transformers_class_and_says_so(runs, command):
    results, marker, _ = runs
    r = results[f"known_{command}"]
    assert r["rc"] == 0, r
    notes = [line for line in r["err"].splitlines() if "names custom code" in line]
    assert len(notes) == 1 and "it is not run: xpar_zoo trains transformers' own 'qwen3_moe' class" in notes[0]
    assert "[y/N]" not in r["out"] + r["err"]
    assert not marker.exists()


def test_nothing_saved_from_a_known_model_type_points_at_custom_code(runs, tmp_path):
    results, marker, _ = runs
    from xpar_zoo.checkpoint import read_checkpoint_metadata

    meta = read_checkpoint_metadata(marker.parent / "known_dcp")
    assert meta["config"]["model_type"] == "qwen3_moe" and "auto_map" not in meta["config"]
    assert "auto_map" not in (marker.parent / "known_hf" / "config.json").read_text()
    assert not list((marker.parent / "known_hf").glob("*.py"))
