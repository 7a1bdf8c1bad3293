"""Checkpoints against attackers and full disks, through the commands (issue 18): no code runs from a crafted .metadata;
every file has a checksum that ``xpar-zoo convert inspect --verify`` checks, and a flipped byte is never loaded nor
exported; a write past the file size limit or onto a full disk is said as such and leaves nothing."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import xpar_zoo
from support.integrity_checkpoints import _model, _payload, _recommit, _snapshot, _unchanged
from xpar_zoo.commands import cli
from xpar_zoo.errors import CheckpointError


@pytest.mark.parametrize("via", ["load_checkpoint", "convert inspect", "convert to-hf"])
def test_a_crafted_metadata_runs_no_code(via, saved, tmp_path, capsys):
    marker = tmp_path / "pwned"
    (saved / ".metadata").write_bytes(_payload(f"touch {marker}"))
    _recommit(saved)
    want = "refers to torch.distributed.checkpoint.metadata.os.system, which a checkpoint never needs"
    if via == "load_checkpoint":
        model = _model(seed=3)
        before = _snapshot(model)
        with pytest.raises(CheckpointError, match=re.escape(want)):
            xpar_zoo.load_checkpoint(saved, model)
        assert _unchanged(model, before)
    else:
        args = ["inspect", str(saved)] if via == "convert inspect" else ["to-hf", str(saved), str(tmp_path / "out")]
        assert cli.main(["convert", *args]) == 2
        assert want in capsys.readouterr().err
    assert not marker.exists(), "the payload ran"


# ---- 4. integrity: checksums ------------------------------------------------------------------------------------
def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_file_has_a_checksum_and_inspect_verify_passes_an_intact_checkpoint(saved, capsys):
    record = json.loads((saved / "COMPLETE").read_text())
    assert record["checksum"] == "crc32" and set(record["checksums"]) == set(record["files"])
    assert {".metadata", "xpar_checkpoint.json", "extra_state.json", "rng/rank-00000.safetensors"} <= set(
        record["files"]) and any(f.endswith(".distcp") for f in record["files"])
    assert cli.main(["convert", "inspect", "--verify", str(saved.parent)]) == 0
    assert re.search(rf"step-00000001 checksums: {len(record['files'])} files intact \(crc32\)",
                     capsys.readouterr().out)


@pytest.mark.parametrize("file", ["__0_0.distcp", "extra_state.json"])
def test_a_flipped_byte_is_never_loaded_nor_exported(file, saved, tmp_path, capsys):
    from xpar_zoo.converters.export import export_to_hf

    _flip_byte(saved / file)
    model = _model(seed=3)
    before = _snapshot(model)
    with pytest.raises(CheckpointError, match=rf"{re.escape(file)}: crc32 [0-9a-f]{{8}}, [0-9a-f]{{8}} recorded"):
        xpar_zoo.load_checkpoint(saved.parent, model)
    assert _unchanged(model, before)
    assert cli.main(["convert", "inspect", "--verify", str(saved)]) == 2
    captured = capsys.readouterr()
    assert "checksums: DAMAGED" in captured.out and f"damaged checkpoint files: {file}: crc32" in captured.err
    with pytest.raises(CheckpointError, match=f"damaged files: {re.escape(file)}"):
        export_to_hf(saved, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()



_FILL_UP = textwrap.dedent("""
    import json, os, resource, signal, sys
    from xpar_zoo.commands import cli
    from xpar_zoo.testing import parity
    import xpar_zoo
    root, ckpt, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = parity.build_model(parity.tiny_config("qwen3_moe"))
    if limit:  # the file size limit: EFBIG, as a real write would fail
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    out = {}
    try:
        xpar_zoo.save_checkpoint(os.path.join(root, "ckpt"), model)
        out["save"] = ("ok", "")
    except BaseException as e:
        out["save"] = (type(e).__name__, str(e), isinstance(e, xpar_zoo.XparError))
    out["save_left"] = sorted(os.listdir(os.path.join(root, "ckpt")))
    out["to_hf"] = cli.main(["convert", "to-hf", ckpt, os.path.join(root, "out")])
    out["to_hf_left"] = sorted(os.listdir(root))
    print(json.dumps(out))
""")


def _run_filled(tmp_path: Path, prefix: list[str], root: Path, limit: int) -> tuple[dict, str]:
    source = xpar_zoo.save_checkpoint(tmp_path / "source", _model())
    proc = subprocess.run([*prefix, sys.executable, "-c", _FILL_UP, str(root), str(source), str(limit)],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _assert_clear_write_failure(out: dict, stderr: str, root: Path, reason: str) -> None:
    kind, message, is_xpar = out["save"]
    assert (kind, is_xpar) == ("CheckpointError", True), message
    assert f"saving {root / 'ckpt' / 'step-00000000'} failed (nothing was kept)" in message
    assert re.search(rf"{reason} \(writing {re.escape(str(root / 'ckpt'))}/\.tmp-step-00000000-[0-9a-f]+/", message)
    assert out["save_left"] == [], "the failed save must remove its .tmp-"
    assert out["to_hf"] == 2 and out["to_hf_left"] == ["ckpt"]
    error_lines = [line[line.index("xpar-zoo: error:"):] for line in stderr.splitlines() if "xpar-zoo: error:" in line]
    assert error_lines == [f"xpar-zoo: error: writing {root / 'out'} failed: {reason}; nothing was written"]
    assert "Traceback" not in stderr


def test_a_write_past_the_file_size_limit_is_a_clear_error_and_leaves_nothing(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse writes past 60 kB (EFBIG), with no special filesystem: the same path
    through DCP's and torch's writers as a full disk."""
    root = tmp_path / "limited"
    root.mkdir()
    out, stderr = _run_filled(tmp_path, [], root, 60_000)
    _assert_clear_write_failure(out, stderr, root, "File too large")


def _mount_namespace() -> list[str] | None:
    """A command prefix that runs in a private mount namespace where ``mount -t tmpfs`` is allowed, or None."""
    if not shutil.which("unshare"):
        return None
    prefix = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    probe = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null || "
                            "mount -t tmpfs -o size=64k tmpfs \"$TMPDIR\""], capture_output=True,
                           env={**os.environ, "TMPDIR": "/tmp"})
    return prefix if probe.returncode == 0 else None


def test_a_full_disk_is_said_as_such_and_leaves_nothing(tmp_path):
    """A real 120 kB tmpfs (in a private mount namespace) fills up during the save and during the export."""
    prefix = _mount_namespace()
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare/tmpfs refused); the file-size-limit test covers the "
                    "same path")
    root = tmp_path / "small"
    root.mkdir()
    out, stderr = _run_filled(tmp_path, [*prefix, "sh", "-c", f'mount -t tmpfs -o size=120k tmpfs "{root}" && '
                                         'exec "$@"', "sh"], root, 0)
    _assert_clear_write_failure(out, stderr, root, "No space left on device")
