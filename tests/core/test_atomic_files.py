"""kvsched.atomic_files: a file is written whole or not at all."""

from __future__ import annotations

import os

import pytest

from kvsched.atomic_files import replacing, write_text


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    dest = tmp_path / "summary.json"
    dest.write_text("old\n")
    with pytest.raises(RuntimeError, match="disk full"):
        with replacing(dest) as tmp:
            tmp.write_text("half of the new")
            raise RuntimeError("disk full")
    assert dest.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_clean_write_replaces_the_file_and_keeps_the_suffix_for_format_sniffing(tmp_path):
    dest = tmp_path / "plot.png"
    seen = []
    with replacing(dest) as tmp:
        seen.append(tmp.suffix)
        tmp.write_bytes(b"png")
    assert seen == [".png"] and dest.read_bytes() == b"png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


def test_the_written_file_gets_the_umask_mode_not_a_private_temporary_mode(tmp_path):
    old = os.umask(0o022)
    try:
        write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o644


def test_a_missing_folder_is_an_error_not_a_created_tree(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_text(tmp_path / "nope" / "a.txt", "x")
