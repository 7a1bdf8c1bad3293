"""`xpar-zoo convert to-dcp` turns a per-expert hub checkpoint (several files) into an xpar_zoo DCP checkpoint whose
tensors are the in-memory (fused) state dict bit-exactly and which loads on a 2-rank Mesh(ep=2); it is atomic under
SIGKILL and refuses an existing output. `convert inspect` names format, architecture and parameter count from
headers only. `publish` validates the folder, writes a model card and uploads only a valid folder."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import yaml

import xpar_zoo
from xpar_zoo.checkpoint import (
    iter_model_tensors,
    latest_checkpoint,
    read_checkpoint_metadata,
)
from xpar_zoo.commands import cli
from xpar_zoo.testing import launch, parity

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny qwen3_moe: its state dict, the hub per-expert folder (several files), a fused folder, and the
    DCP written from the hub folder by the CLI in small batches (several DCP files, one merged .metadata)."""
    from safetensors.torch import save_file

    base = tmp_path_factory.mktemp("to_dcp")
    config = parity.tiny_config("qwen3_moe")
    model = parity.build_model(config).eval()
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    hub = base / "hub"
    model.save_pretrained(hub, max_shard_size="20KB")
    fused = base / "fused"
    fused.mkdir()
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(fused)
    out = base / "dcp"
    assert cli.main(["convert", "to-dcp", str(hub), str(out), "--batch-size", "30KB"]) == 0
    return {"base": base, "hub": hub, "fused": fused, "dcp": out, "state": state,
            "params": sum(p.numel() for p in model.parameters())}


def _assert_equal_state(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


# ---- to-dcp -----------------------------------------------------------------------------------------------------
def test_to_dcp_of_per_expert_hub_is_the_fused_state_dict_bit_exactly(tiny):
    index = json.loads((tiny["hub"] / INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 3 and any(".experts.0.up_proj" in k for k in index["weight_map"])
    step = latest_checkpoint(tiny["dcp"])
    assert step == tiny["dcp"] / "step-00000000"
    assert len(list(step.glob("*.distcp"))) > 1  # written in several batches, indexed by one .metadata
    _assert_equal_state(dict(iter_model_tensors(tiny["dcp"])), tiny["state"])
    meta = read_checkpoint_metadata(tiny["dcp"])
    assert meta["step"] == 0 and meta["model_type"] == "qwen3_moe" and meta["mesh"] is None
    assert meta["config"]["num_local_experts"] == 8 and meta["optimizer"] is None
    assert meta["converted_from"]["layout"] == "hub per-expert"


def test_to_dcp_of_fused_hub_folder_too(tiny):
    out = tiny["base"] / "dcp_fused"
    assert cli.main(["convert", "to-dcp", str(tiny["fused"]), str(out)]) == 0
    _assert_equal_state(dict(iter_model_tensors(out)), tiny["state"])
    assert read_checkpoint_metadata(out)["converted_from"]["layout"] == "hub fused"


def _load_ep2(dcp_dir: str) -> dict:
    model = xpar_zoo.parallelize(parity.build_model(parity.tiny_config("qwen3_moe"), seed=123),
                                 xpar_zoo.Mesh(ep=2))
    xpar_zoo.load_checkpoint(dcp_dir, model)
    return xpar_zoo.full_state_dict(model)


def test_to_dcp_output_loads_on_ep2_mesh_with_equal_full_state_dict(tiny):
    got = launch.run(_load_ep2, 2, str(tiny["dcp"]), timeout_s=120)
    _assert_equal_state({k: v for k, v in got.items()}, tiny["state"])


def test_existing_output_is_refused_and_bad_inputs_are_named(tiny, tmp_path, capsys):
    assert cli.main(["convert", "to-dcp", str(tiny["hub"]), str(tiny["dcp"])]) == 2
    assert "already exists" in capsys.readouterr().err
    no_config = tmp_path / "no_config"
    shutil.copytree(tiny["hub"], no_config)
    (no_config / "config.json").unlink()
    assert cli.main(["convert", "to-dcp", str(no_config), str(tmp_path / "o1")]) == 2
    assert "without config.json" in capsys.readouterr().err
    gone = tmp_path / "missing_shard"
    shutil.copytree(tiny["hub"], gone)
    (gone / "model-00002-of-00010.safetensors").unlink()
    assert cli.main(["convert", "to-dcp", str(gone), str(tmp_path / "o2")]) == 2
    assert "lists model-00002-of-00010.safetensors" in capsys.readouterr().err
    cut = tmp_path / "truncated"
    shutil.copytree(tiny["hub"], cut)
    shard = cut / "model-00003-of-00010.safetensors"
    shard.write_bytes(shard.read_bytes()[:40])
    assert cli.main(["convert", "to-dcp", str(cut), str(tmp_path / "o3")]) == 2
    assert "model-00003-of-00010.safetensors" in capsys.readouterr().err
    short = tmp_path / "truncated_data"  # found only while converting: the temporary directory is removed
    shutil.copytree(tiny["hub"], short)
    shard = short / "model-00004-of-00010.safetensors"
    shard.write_bytes(shard.read_bytes()[:-16])
    assert cli.main(["convert", "to-dcp", str(short), str(tmp_path / "o4")]) == 2
    assert "model-00004-of-00010.safetensors: truncated" in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert cli.main(["convert", "to-dcp", str(tiny["hub"]), str(a_file / "out")]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert not any((tmp_path / n).exists() for n in ("o1", "o2", "o3", "o4"))
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def _killed_conversion(hub, out, force: bool) -> None:
    """Run to-dcp in a subprocess slowed down per tensor; SIGKILL it once its temporary directory has data."""
    force_flag = ', "--force"' if force else ""
    script = textwrap.dedent(f"""
        import time
        from xpar_zoo.commands import cli
        import xpar_zoo.converters.to_dcp as td
        real = td.assemble
        def slow(*a, **k):
            time.sleep(0.1); return real(*a, **k)
        td.assemble = slow
        cli.main(["convert", "to-dcp", {str(hub)!r}, {str(out)!r}, "--batch-size", "10KB"{force_flag}])
    """)
    log = open(out.parent / f"{out.name}.log", "w+b")  # a file, not a pipe: the child never blocks on its output
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=log)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and not any(
            p.name.startswith(f".{out.name}.tmp-") and any(p.rglob("*.distcp")) for p in out.parent.iterdir()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    code = proc.wait()
    log.seek(0)
    err = log.read().decode(errors="replace")
    log.close()
    assert code == -signal.SIGKILL, f"the conversion ended before it was killed (exit {code}):\n{err[-2000:]}"


def test_sigkill_during_to_dcp_leaves_no_output_and_the_earlier_one_intact(tiny, tmp_path):
    earlier = tmp_path / "earlier"
    shutil.copytree(tiny["dcp"], earlier)
    _killed_conversion(tiny["hub"], earlier, force=True)
    assert latest_checkpoint(earlier) == earlier / "step-00000000"
    _assert_equal_state(dict(iter_model_tensors(earlier)), tiny["state"])
    fresh = tmp_path / "fresh"
    _killed_conversion(tiny["hub"], fresh, force=False)
    assert not fresh.exists()
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".fresh.tmp-")]  # the interrupted temp dir
    assert left
    # A staging directory whose writer is alive (here: this process holds its lock) is only warned about.
    from xpar_zoo.io.atomic_dir import LeftoverWarning, StagingDir

    running = StagingDir(fresh)
    with pytest.warns(LeftoverWarning) as warned:
        assert cli.main(["convert", "to-dcp", str(tiny["hub"]), str(fresh)]) == 0
    messages = " ".join(str(w.message) for w in warned)
    assert f"removed {left[0]}" in messages and running.path.name in messages and "still running" in messages
    assert running.path.is_dir() and not (tmp_path / left[0]).exists()
    running.discard()
    assert latest_checkpoint(fresh) is not None


# ---- inspect ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which, fmt", [("hub", "hub per-expert"), ("fused", "hub fused"),
                                        ("dcp", "xpar_zoo DCP checkpoint root")])
def test_inspect_names_format_architecture_and_parameters(tiny, which, fmt, capsys):
    assert cli.main(["convert", "inspect", str(tiny[which]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == fmt and info["model_type"] == "qwen3_moe" and info["parameters"] == tiny["params"]
    assert sum(info["dtypes"].values()) >= 1 and info.get("shards") or info["latest"]["shards"]
    assert cli.main(["convert", "inspect", str(tiny[which])]) == 0
    text = capsys.readouterr().out
    assert fmt in text and "qwen3_moe" in text and f"{tiny['params']:,}" in text


def test_inspect_step_dir_reports_step_mesh_and_incomplete_checkpoints(tiny, tmp_path, capsys):
    root = tmp_path / "root"
    shutil.copytree(tiny["dcp"], root)
    shutil.copytree(root / "step-00000000", root / "step-00000005")
    (root / "step-00000005" / "COMPLETE").unlink()
    assert cli.main(["convert", "inspect", str(root / "step-00000000"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "xpar_zoo DCP checkpoint" and info["step"] == 0 and info["complete"]
    assert "mesh" in info and info["plans"] == {}
    assert cli.main(["convert", "inspect", str(root), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [c["dir"] for c in info["incomplete"]] == ["step-00000005"]
    assert "COMPLETE" in info["incomplete"][0]["reason"]
    plain = tmp_path / "plain"
    import torch.distributed.checkpoint as dcp

    from xpar_zoo.checkpoint.dcp_io import quiet_single_process

    with quiet_single_process():
        dcp.save({"w": torch.ones(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
                 storage_writer=dcp.FileSystemWriter(str(plain)), no_dist=True)
    assert cli.main(["convert", "inspect", str(plain), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "plain DCP" and info["parameters"] == 14
    assert info["dtypes"] == {"float32": 1, "bfloat16": 1}


# ---- publish ----------------------------------------------------------------------------------------------------
@pytest.fixture
def uploads(monkeypatch):
    """huggingface_hub's network calls, intercepted: each records its arguments."""
    from huggingface_hub import HfApi

    calls = []
    for method in ("create_repo", "create_branch", "upload_folder"):
        def record(self, *args, _m=method, **kwargs):
            calls.append((_m, args, kwargs))
            return f"https://huggingface.co/{kwargs.get('repo_id', args[0] if args else '')}/commit/0"
        monkeypatch.setattr(HfApi, method, record)
    return calls


def _front_matter(readme) -> dict:
    text = readme.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_publish_writes_a_model_card_and_uploads_the_folder(tiny, tmp_path, uploads):
    folder = tmp_path / "export"
    shutil.copytree(tiny["hub"], folder)
    (folder / "xpar_export.json").write_text(json.dumps(
        {"base_model": "org/tiny-base", "mesh": {"ep": 2, "emb": 2}, "plans": ["emb", "ep"], "step": 7}))
    assert cli.main(["publish", str(folder), "me/tiny-moe", "--private", "--revision", "v1", "--token", "t0k"]) == 0
    card = _front_matter(folder / "README.md")
    assert card["library_name"] == "xpar_zoo" and card["base_model"] == "org/tiny-base"
    assert {"xpar_zoo", "moe", "qwen3_moe"} <= set(card["tags"])
    assert card["xpar_zoo"]["mesh"] == {"ep": 2, "emb": 2} and card["xpar_zoo"]["step"] == 7
    assert card["xpar_zoo"]["layout"] == "hub per-expert" and card["xpar_zoo"]["num_experts"] == 8
    names = [c[0] for c in uploads]
    assert names == ["create_repo", "create_branch", "upload_folder"]
    _, args, kwargs = uploads[0]
    assert args == ("me/tiny-moe",) and kwargs["private"] is True and kwargs["exist_ok"] is True
    assert uploads[1][2]["branch"] == "v1"
    up = uploads[2][2]
    assert up["repo_id"] == "me/tiny-moe" and up["folder_path"] == str(folder) and up["revision"] == "v1"
    # an existing card is kept unless --overwrite-card; --base-model wins over the export's
    (folder / "README.md").write_text("my card\n")
    assert cli.main(["publish", str(folder), "me/tiny-moe"]) == 0
    assert (folder / "README.md").read_text() == "my card\n"
    assert cli.main(["publish", str(folder), "me/tiny-moe", "--overwrite-card", "--base-model", "Qwen/Other"]) == 0
    assert _front_matter(folder / "README.md")["base_model"] == "Qwen/Other"


@pytest.mark.parametrize("damage, message", [
    ("no_config", "no config.json"),
    ("missing_shard", "lists model-00002-of-00010.safetensors"),
    ("truncated_header", "model-00003-of-00010.safetensors"),
    ("truncated_data", "truncated"),
])
def test_publish_refuses_a_bad_folder_before_any_upload(tiny, tmp_path, uploads, capsys, damage, message):
    folder = tmp_path / "bad"
    shutil.copytree(tiny["hub"], folder)
    shard = folder / "model-00003-of-00010.safetensors"
    if damage == "no_config":
        (folder / "config.json").unlink()
    elif damage == "missing_shard":
        (folder / "model-00002-of-00010.safetensors").unlink()
    elif damage == "truncated_header":
        shard.write_bytes(shard.read_bytes()[:40])
    else:
        shard.write_bytes(shard.read_bytes()[:-16])
    assert cli.main(["publish", str(folder), "me/tiny-moe"]) == 2
    assert message in capsys.readouterr().err
    assert uploads == [] and not (folder / "README.md").exists()


_MEASURE = """
import gc, json, sys, threading, time
from xpar_zoo.commands import cli

def rss_mib(field="VmRSS"):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024

tiny, hub, out = sys.argv[1:4]
cli.main(["convert", "to-dcp", tiny, out + "-warm"])  # imports and first-call allocations, outside the measure
gc.collect()
base, peak, done = rss_mib(), [0.0], threading.Event()
base_anon, peak_anon = rss_mib("RssAnon"), [0.0]

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss_mib())
        peak_anon[0] = max(peak_anon[0], rss_mib("RssAnon"))
        time.sleep(0.002)

thread = threading.Thread(target=sample)
thread.start()
rc = cli.main(["convert", "to-dcp", hub, out, "--batch-size", "32MiB"])
done.set()
thread.join()
print(json.dumps({"rc": rc, "growth_mib": peak[0] - base, "anon_growth_mib": peak_anon[0] - base_anon}))
"""


def test_to_dcp_memory_stays_near_one_batch_not_the_model(tiny, tmp_path):
    """A 200 MiB per-expert checkpoint converted 32 MiB at a time (its largest fused tensor is 32 MiB): the peak
    RSS growth stays near one and a half batches (48 MiB, measured again and again), far below the model. The bound
    is 2.5 batches: a full suite on 2 busy cores once read 64.4 MiB."""
    config = parity.tiny_config("qwen3_moe", hidden_size=512, moe_intermediate_size=512, num_hidden_layers=4,
                                num_local_experts=16, vocab_size=1024)
    model = parity.build_model(config)
    model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    model.save_pretrained(tmp_path / "hub", max_shard_size="64MB")
    del model
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(tiny["hub"]), str(tmp_path / "hub"),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rc"] == 0 and model_mib > 190
    print(f"to-dcp peak RSS growth {result['growth_mib']:.0f} MiB (anonymous {result['anon_growth_mib']:.0f}) for a {model_mib:.0f} MiB model")
    assert result["growth_mib"] < 2.5 * 32, result
    assert latest_checkpoint(tmp_path / "out") is not None


def test_to_dcp_of_an_offline_hub_id_at_a_revision_then_to_hf_gives_back_the_hub_files(tiny, tmp_path, uploads):
    """A hub id at a commit, from an offline huggingface_hub cache → DCP → `convert to-hf`: the hub's own tensors;
    the export publishes with its facts (xpar_export.json) on the card."""
    from safetensors.torch import load_file

    repo, commit = "org/tiny-qwen3-moe", "0123456789abcdef0123456789abcdef01234567"
    cache = tmp_path / "hf_cache"
    entry = cache / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    shutil.copytree(tiny["hub"], entry / "snapshots" / commit)
    out = tmp_path / "from_hub"
    proc = subprocess.run([sys.executable, "-m", "xpar_zoo", "convert", "to-dcp", repo, str(out), "--revision", commit],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    _assert_equal_state(dict(iter_model_tensors(out)), tiny["state"])
    src = read_checkpoint_metadata(out)["converted_from"]
    assert (src["origin"], src["revision"], src["commit"]) == (repo, commit, commit)
    back = tmp_path / "back"
    assert cli.main(["convert", "to-hf", str(out), str(back), "--max-shard-size", "20KB"]) == 0

    def hub_tensors(directory):
        return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}

    _assert_equal_state(hub_tensors(back), hub_tensors(tiny["hub"]))
    assert cli.main(["publish", str(back), "me/round-trip", "--base-model", repo]) == 0
    card = _front_matter(back / "README.md")
    assert card["base_model"] == repo and card["xpar_zoo"]["step"] == 0
    assert card["xpar_zoo"]["model_type"] == "qwen3_moe"
    assert [c[0] for c in uploads] == ["create_repo", "upload_folder"]
