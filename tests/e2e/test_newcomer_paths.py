"""The newcomer's path: `size` names a tiny model's parameters in human units; `convert to-hf RUN_DIR` and
`convert inspect RUN_DIR` take a training run directory (its checkpoints/); a mistyped local path is said to be
missing at once (never looked up on the hub); an unreachable hub (HF_ENDPOINT on a closed loopback port) or
offline mode is said in one line within seconds, and a cached hub id still resolves then."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import xpar_zoo
from xpar_zoo.commands import cli
from xpar_zoo.testing import parity

BOUND_S = 20  # measured inside the process, imports excluded (lazy first imports took 12 s on a loaded 2-core host): a
# retried request alone takes 30 s and more
UNREACHABLE = "http://127.0.0.1:9"  # loopback, the discard port: nothing listens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("newcomer")
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    model.save_pretrained(base / "hub")
    xpar_zoo.save_checkpoint(base / "run" / "checkpoints", model, step=3)
    (base / "run" / "metrics.jsonl").write_text("")
    return base, sum(p.numel() for p in model.parameters())


def test_size_prints_a_small_models_parameters_in_human_units(tiny, capsys):
    base, params = tiny
    assert cli.main(["size", str(base / "hub"), "--world", "2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert f"{params / 1e3:.1f}K parameters" in first and "0.00B" not in first, first


def test_convert_to_hf_takes_a_training_run_directory(tiny, tmp_path):
    base, _ = tiny
    assert cli.main(["convert", "to-hf", str(base / "run"), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "xpar_export.json").read_text())["step"] == 3


def test_convert_inspect_takes_a_training_run_directory(tiny, capsys):
    base, _ = tiny
    assert cli.main(["convert", "inspect", str(base / "run"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "xpar_zoo DCP checkpoint root" and info["path"].endswith("checkpoints")


SCRIPT = textwrap.dedent("""
    import contextlib, io, json, sys, time
    from xpar_zoo.commands import cli
    out = {}
    for case, argv in json.loads(sys.argv[1]).items():
        err = io.StringIO()
        start = time.monotonic()
        with contextlib.redirect_stderr(err):
            rc = cli.main(argv)
        out[case] = {"rc": rc, "seconds": time.monotonic() - start, "err": err.getvalue()}
    print(json.dumps(out))
""")
INVALID_IDS = ("org/..", "org/my model")
MISTYPED = ["./my-model", "../models/my-model", "/nonexistent/my-model", "~/my-model", "my-model", "org/..",
            "org/my model", "models/qwen/my-model"]


def _run(commands, env, cwd):
    """The CLI commands in one process started with ``env`` (huggingface_hub reads it at import), stdin closed."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(commands)], capture_output=True, text=True,
                          timeout=600, cwd=cwd, stdin=subprocess.DEVNULL,
                          env={**{k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hub_runs(tiny):
    """Every hub-resolution case, in one process per environment: an unreachable hub (with a cache holding
    org/cached-moe) and offline mode."""
    base, _ = tiny
    cache, work = base / "hf_cache", base / "work"
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = cache / "models--org--cached-moe"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    shutil.copytree(base / "hub", entry / "snapshots" / commit)
    work.mkdir()
    unreachable = {f"mistyped {n}": ["convert", "to-dcp", n, str(work / f"out{i}")] for i, n in enumerate(MISTYPED)}
    unreachable.update({"to-dcp": ["convert", "to-dcp", "org/tiny-moe", str(work / "out")],
                        "size": ["size", "org/tiny-moe", "--world", "2"],
                        "cached": ["convert", "to-dcp", "org/cached-moe", str(work / "cached")]})
    offline = {"to-dcp": ["convert", "to-dcp", "org/tiny-moe", str(work / "out")],
               "size": ["size", "org/tiny-moe", "--world", "2"]}
    return {"unreachable": _run(unreachable, {"HF_ENDPOINT": UNREACHABLE, "HF_HUB_CACHE": str(cache)}, work),
            "offline": _run(offline, {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}, work), "work": work}


@pytest.mark.parametrize("name", MISTYPED)
def test_a_mistyped_local_path_is_missing_at_once(hub_runs, name):
    r = hub_runs["unreachable"][f"mistyped {name}"]
    lines = r["err"].strip().splitlines()
    said = (f"{name!r} is neither a local directory nor a valid hub repo id" if name in INVALID_IDS
            else f"{name} does not exist (no such local directory")
    assert r["rc"] == 2 and len(lines) == 1 and said in lines[0], r
    assert r["seconds"] < 1 and "Retrying" not in r["err"]


@pytest.mark.parametrize("mode, said", [("unreachable", f"the hub at {UNREACHABLE} is unreachable"),
                                        ("offline", "HF_HUB_OFFLINE=1")])
@pytest.mark.parametrize("command", ["to-dcp", "size"])
def test_an_unreachable_or_offline_hub_is_said_in_one_line_at_once(hub_runs, mode, said, command):
    r = hub_runs[mode][command]
    lines = r["err"].strip().splitlines()
    assert r["rc"] == 2 and len(lines) == 1, r
    assert "'org/tiny-moe'" in lines[0] and said in lines[0] and "only the local huggingface_hub cache" in lines[0]
    assert r["seconds"] < BOUND_S and "Retrying" not in r["err"]
    assert not (hub_runs["work"] / "out").exists()


def test_a_cached_hub_id_resolves_while_the_hub_is_unreachable(hub_runs):
    r = hub_runs["unreachable"]["cached"]
    assert r["rc"] == 0 and r["seconds"] < BOUND_S, r
    assert (hub_runs["work"] / "cached").is_dir()
