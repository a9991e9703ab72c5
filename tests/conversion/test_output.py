# SPDX-License-Identifier: Apache-2.0
"""The output folder (CPU): an existing output is refused unless overwrite, and never inside the source."""

import os

import pytest

from dar_transformers.conversion import upcycle

from conftest import FAST, save_source


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    source = save_source(tmp_path / "source")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="exists and is not empty.*--overwrite"):
        upcycle(source, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(FileExistsError, match="not a previous conversion output"):  # --overwrite replaces only those
        upcycle(source, out, overwrite=True, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    upcycle(source, out, tolerance=1e-5, **FAST)  # an empty folder is used as is
    (out / "stale.txt").write_text("from a previous conversion")
    written = (out / "README.md").stat().st_mtime_ns - 10**9  # before its card, as a conversion writes everything
    os.utime(out / "stale.txt", ns=(written, written))
    upcycle(source, out, overwrite=True, tolerance=1e-5, **FAST)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors.index.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "source"]  # nothing retired or staged is left
    with pytest.raises(ValueError, match="lies inside the source"):
        upcycle(source, source / "dar", progress=False)
