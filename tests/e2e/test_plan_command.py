"""``xpar-zoo plan`` reads a cached hub config offline and names bad models."""

from xpar_zoo.testing import parity

_PLAN_CLI = """
import contextlib, io, json, sys
from xpar_zoo.commands import cli

out = []
for argv in json.loads(sys.argv[1]):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = cli.main(argv)
    out.append([rc, stdout.getvalue(), stderr.getvalue()])
print(json.dumps(out))
"""


def test_plan_cli_reads_a_cached_hub_config_offline_and_names_bad_models(tmp_path):
    """``xpar-zoo size`` needs only config.json: a hub id from an offline cache works; a missing or malformed name,
    a mesh that does not divide the world, or one whose shards parallelize would refuse, is one clear error (exit 2,
    no traceback)."""
    import json
    import os
    import subprocess
    import sys

    repo, commit = "org/planned-moe", "0123456789abcdef0123456789abcdef01234567"
    entry = tmp_path / "hf_cache" / f"models--{repo.replace('/', '--')}"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    parity.tiny_config("qwen3_moe").save_pretrained(entry / "snapshots" / commit)  # config.json only: no weights
    cases = [(["size", repo, "--world", "4", "--ep", "2"], 0, "all_to_all (EP tokens)"),
             (["plan", "org/not-cached", "--world", "4"], 2, "cannot get the config.json of 'org/not-cached'"),
             (["plan", str(tmp_path), "--world", "4"], 2, "is a directory without config.json"),
             (["plan", "bad id!!", "--world", "4"], 2, "neither a local directory nor a valid hub repo id"),
             (["plan", "qwen3_moe", "--world", "4", "--ep", "3"], 2, "'ep' of size 3 does not divide"),
             (["plan", "qwen3_moe", "--world", "12", "--ep", "2"], 2, "not divisible by ep_fsdp=6"),
             (["plan", "qwen3_moe", "--world", "8", "--ep", "2", "--recompute"], 0, "activation checkpointing"),
             (["plan", "llama", "--world", "4", "--ep", "2"], 2, "mesh uses plan(s) ['ep'] that the 'llama' plan")]
    proc = subprocess.run([sys.executable, "-c", _PLAN_CLI, json.dumps([argv for argv, _, _ in cases])],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf_cache"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    for (argv, want_rc, message), (rc, out, err) in zip(cases, json.loads(proc.stdout.splitlines()[-1])):
        assert rc == want_rc and message in (out if rc == 0 else err), (argv, rc, out[-300:], err[-300:])
        assert "Traceback" not in err, err
