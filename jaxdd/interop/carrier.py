"""Published weights that ship inside another package's wheel, found without importing it.

SevenNet's checkpoints ship in the ``sevenn`` wheel and CHGNet's in ``chgnet``; importing either
imports torch. The wheel is installed without its dependencies (``pip install --no-deps``) as a
carrier of the files, and its folder is located through the import system's metadata only.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
from collections.abc import Mapping

__all__ = ["package_folder", "carried_file"]


def package_folder(package: str) -> pathlib.Path | None:
    """The installed folder of ``package``, found without importing it.

    Args:
      package: the import name (``"sevenn"``), which is also its distribution's name.

    Returns:
      the folder, or None where the package is not installed.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return pathlib.Path(list(spec.submodule_search_locations)[0])
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    return pathlib.Path(dist.locate_file(package))


def carried_file(name_or_path, files: Mapping[str, str], package: str, owner: str,
                 aliases: Mapping[str, str] | None = None) -> str:
    """The file of a published model's name, or ``name_or_path`` itself as a path.

    Args:
      name_or_path: a key of ``files`` or ``aliases`` (case-insensitive), or a path.
      files: published name (lower case) → the file's path inside the package folder.
      package: the carrier package (``"sevenn"``, ``"chgnet"``).
      owner: the model family, for messages (``"SevenNet"``).
      aliases: further spellings (lower case) → a key of ``files``.

    Returns:
      the file's path.

    Raises:
      FileNotFoundError: a name whose carrier is not installed (saying how to install it), a
        carrier without the file, or a path that does not exist (listing the published names).
    """
    text = os.fspath(name_or_path)
    key = (aliases or {}).get(text.lower(), text.lower())
    if key in files:
        folder = package_folder(package)
        if folder is None:
            raise FileNotFoundError(
                f"{owner} checkpoint {text!r} ships in the {package} wheel, which is not installed; install it as a "
                f"carrier of the files (no torch needed): pip install --no-deps {package}")
        path = folder / files[key]
        if not path.is_file():
            raise FileNotFoundError(f"the installed {package} ({folder}) has no {files[key]}; "
                                    f"reinstall it: pip install --no-deps --force-reinstall {package}")
        return str(path)
    if not os.path.exists(text):
        known = ", ".join(repr(k) for k in files)
        raise FileNotFoundError(f"{owner} checkpoint {text!r} is neither a file nor a published model ({known})")
    return text
