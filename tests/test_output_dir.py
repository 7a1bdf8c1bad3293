"""The converters' atomic output directories: what an interrupted conversion leaves is removed only when provably
abandoned, a renamed-aside old output is never removed automatically, a failed final rename puts the old output
back, and output names are matched literally."""

import os
import subprocess
import sys

import pytest

from xpar_zoo.io.atomic_dir import LOCK_FILE, LeftoverWarning, StagingDir, check_output, move_into_place


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


def test_an_old_output_renamed_aside_is_never_removed_and_the_warning_says_how_to_restore_it(tmp_path):
    out = tmp_path / "model"
    aside = tmp_path / ".model.deleting-89abcdef"
    aside.mkdir()
    (aside / "config.json").write_text("{}")
    with pytest.warns(LeftoverWarning, match="rename it back to model"):
        check_output(out, force=False)
    assert (aside / "config.json").exists()


def test_a_failed_final_rename_puts_the_old_output_back(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    with pytest.raises(FileNotFoundError):
        move_into_place(tmp_path / ".out.tmp-missing0", out)
    assert (out / "old").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


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
