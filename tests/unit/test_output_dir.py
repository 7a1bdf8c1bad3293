"""The converters' atomic output directories: what an interrupted conversion leaves is removed only when provably
abandoned, a renamed-aside old output is never removed automatically, a failed final rename puts the old output
back, and output names are matched literally."""

import pytest

from xpar_zoo.io.atomic_dir import LeftoverWarning, check_output, move_into_place


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
