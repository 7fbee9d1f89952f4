"""A fingerprint of the graders' own code, to check that grading ran the installed graders.

An instructor records it before autograde (``python -m graders.course fingerprint``, which writes
``.lora_book_fingerprint.json`` into the course folder); ``python -m graders.course verify``
compares the files with it before and after its re-grade, so a learner process that rewrote a
grader or reference file (and restored it, mtime included) is caught as long as the file still
differs when verify runs, and a file changed during verify's own re-grade is caught after it.

Only the ``.py`` files of the ``graders`` and ``reference`` packages are covered (not torch or
triton, nor compiled ``__pycache__`` files, which Python rewrites itself).
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

__all__ = ["PACKAGES", "package_roots", "fingerprint", "check_fingerprint"]

#: The packages whose code decides a score.
PACKAGES = ("graders", "reference")


def package_roots() -> dict[str, Path]:
    """The folder of each of :data:`PACKAGES` as Python finds it now (without importing it).

    Raises:
        ModuleNotFoundError: a package is not installed.
    """
    roots = {}
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"package {name!r} not found")
        roots[name] = Path(list(spec.submodule_search_locations)[0]).resolve()
    return roots


def fingerprint() -> dict[str, str]:
    """sha256 of every ``.py`` file of the installed ``graders`` and ``reference`` packages.

    Returns:
        {``"graders/machine/core.py"``: hex digest, ...}: paths relative to each package's parent folder
        (the package name first, then the path inside it, with ``/``), sorted.

    Raises:
        ModuleNotFoundError: a package is not installed.
    """
    out = {}
    for name, root in package_roots().items():
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = f"{name}/{path.relative_to(root).as_posix()}"
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return dict(sorted(out.items()))


def check_fingerprint(recorded: dict) -> list[str]:
    """How the graders' files now differ from ``recorded`` (a :func:`fingerprint`).

    Returns:
        One line per difference ("graders/machine/core.py changed", "... is new", "... is missing"),
        sorted by path; empty when every file is the same.

    Raises:
        ModuleNotFoundError: a package is not installed.
    """
    now = fingerprint()
    lines = []
    for path in sorted(set(recorded) | set(now)):
        if path not in now:
            lines.append(f"{path} is missing (it was recorded)")
        elif path not in recorded:
            lines.append(f"{path} is new (not in the recorded fingerprint)")
        elif now[path] != recorded[path]:
            lines.append(f"{path} changed (sha256 {recorded[path][:12]}... recorded, {now[path][:12]}... now)")
    return lines
