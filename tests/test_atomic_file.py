"""workers/atomic_file.py: a write replaces the whole file or nothing."""

from __future__ import annotations

import pytest

from workers.atomic_file import write_text_atomic


def test_write_creates_the_folder_and_replaces_the_file(tmp_path):
    path = tmp_path / "deep" / "state.json"
    write_text_atomic(path, "first\n")
    write_text_atomic(path, "second\n")
    assert path.read_text() == "second\n"
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]  # no temporary file left


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.json"
    write_text_atomic(path, "kept\n")
    with pytest.raises(TypeError):
        write_text_atomic(path, b"not text")  # fails after the temporary file was created
    assert path.read_text() == "kept\n"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
