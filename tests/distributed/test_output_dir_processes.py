"""Output directories against other processes: abandoned staging directories are removed while live (locked) ones and
unlocked ones of other names are kept, output names are matched literally, and nothing is cleaned before the
already-exists refusal (each with a second process that holds or held a lock)."""

import os
import subprocess
import sys

import pytest

from xpar_zoo.io.atomic_dir import LOCK_FILE, LeftoverWarning, StagingDir, check_output


def _abandoned_staging(out_dir):
    """A staging directory whose writer (another process) has exited: its lock file is there, unlocked."""
    code = ("import sys; from pathlib import Path; from xpar_zoo.io.atomic_dir import StagingDir; "
            "s = StagingDir(Path(sys.argv[1])); (s.path / 'part').write_text('x'); print(s.path.name)")
    out = subprocess.run([sys.executable, "-c", code, str(out_dir)], capture_output=True, text=True, check=True)
    return out_dir.parent / out.stdout.strip()


def test_abandoned_staging_is_removed_live_and_unlocked_ones_are_kept(tmp_path):
    out = tmp_path / "out"
    dead = _abandoned_staging(out)
    assert (dead / LOCK_FILE).exists()
    live = StagingDir(out)
    legacy = tmp_path / ".out.tmp-0123abcd"  # no lock file: cannot tell, so only warned about
    legacy.mkdir()
    with pytest.warns(LeftoverWarning) as warned:
        check_output(out, force=False)
    text = " ".join(str(w.message) for w in warned)
    assert f"removed {dead.name}" in text and live.path.name in text and legacy.name in text
    assert not dead.exists() and live.path.is_dir() and legacy.is_dir()
    live.commit()
    assert out.is_dir() and not (out / LOCK_FILE).exists()



def test_output_names_are_matched_literally(tmp_path):
    out = tmp_path / "out[1]"
    other = _abandoned_staging(tmp_path / "out1")  # '[1]' as a glob would match 'out1'
    mine = _abandoned_staging(out)
    with pytest.warns(LeftoverWarning, match="removed"):
        check_output(out, force=False)
    assert other.is_dir() and not mine.exists()


def test_no_cleanup_before_the_already_exists_refusal(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = _abandoned_staging(out)
    with pytest.raises(ValueError, match="already exists"):
        check_output(out, force=False)
    assert dead.is_dir() and os.path.exists(dead / LOCK_FILE)
