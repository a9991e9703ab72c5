# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""The output folder of a conversion: checked against the source, written in a staging folder, moved into place."""

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def check_output_folder(output: str | os.PathLike, overwrite: bool, source: object = None) -> Path:
    """Refuse an existing non-empty output (unless overwrite), a file, or a folder that is or holds the source."""
    output = Path(output).absolute()
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"Output {output} exists and is not a folder.")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise FileExistsError(f"Output folder {output} exists and is not empty; pass overwrite=True (--overwrite).")
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():  # a GGUF file's neighbours are no source
        source_folder = Path(source).absolute()
        if output == source_folder or source_folder in output.parents:
            raise ValueError(
                f"Output folder {output} is or lies inside the source folder {source_folder}; the source is never modified."
            )
    return output


def _apply_umask(folder: Path) -> None:
    """mkdtemp (and some writers) create owner-only entries; give the repo the modes a plain mkdir/open would."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def write_repo_folder(output: Path, write: Callable[[Path], None], overwrite: bool) -> None:
    """Run `write(folder)` on a temporary folder next to `output`, then rename it into place (all or nothing)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent))
    try:
        write(staging)
        _apply_umask(staging)
        check_output_folder(output, overwrite)  # the output may have appeared while we worked
        if output.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".old", dir=output.parent))
            os.replace(output, retired / output.name)
            os.replace(staging, output)
            shutil.rmtree(retired)
        else:
            os.replace(staging, output)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
