"""Bounds on the processes and memory of one sandbox, through cgroups, where the host lets us.

An rlimit on processes (RLIMIT_NPROC) counts every process of the user, is shared by every sandbox
of that user and does not bind root at all; RLIMIT_AS bounds one process's address space, not a
sandbox's. A cgroup bounds the sandbox as a whole: the process that starts bwrap moves itself into a
cgroup of its own (:func:`enter`), and everything the sandbox starts is counted there (``pids.max``:
:data:`PIDS_MAX` processes; the memory controller: :func:`memory_limit_mb`, past which the kernel's
OOM killer ends a process of that sandbox).

Where it works: cgroup v1 with the ``pids`` and ``memory`` hierarchies writable (root, or a
delegated hierarchy), or cgroup v2 where this process's cgroup is delegated to us (a child can be
created and given ``pids.max`` and ``memory.max``). Elsewhere nothing is bounded here and
:func:`available` says so; the rlimits of ``graders.machine.sandbox.limit_resources`` still apply (the
README's threat model says what that leaves).

Leftover cgroups (a sandbox ended) are empty; each :func:`enter` first removes the empty ones it
finds of earlier sandboxes.
"""
from __future__ import annotations

import functools
import os
import uuid
from pathlib import Path
from typing import Optional

__all__ = ["PIDS_MAX", "MEMORY_ENV", "memory_limit_mb", "available", "enter"]

#: Processes one sandbox may have at once (its bwrap, its init and everything learner code starts).
PIDS_MAX = 256
#: Memory of one sandbox, MiB (``LORA_BOOK_SANDBOX_MEMORY_MB`` overrides).
MEMORY_ENV = "LORA_BOOK_SANDBOX_MEMORY_MB"
MEMORY_MB = 8192
_PREFIX = "lora-book-sandbox-"
_ROOT = Path("/sys/fs/cgroup")


def memory_limit_mb() -> int:
    return int(os.environ.get(MEMORY_ENV, MEMORY_MB))


def _own_cgroups() -> dict[str, str]:
    """{controller or "" (v2): path of this process's cgroup}."""
    found = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            found[c] = path
    return found


def _parents() -> Optional[dict[str, Path]]:
    """Where this process may create a sandbox's cgroups: {"pids": folder, "memory": folder}
    (cgroup v1) or {"v2": folder}; None when neither is writable here."""
    own = _own_cgroups()
    v1 = {c: _ROOT / c / own[c].lstrip("/") for c in ("pids", "memory") if c in own}
    if len(v1) == 2 and all((p / "cgroup.procs").exists() and os.access(p, os.W_OK) for p in v1.values()):
        return v1
    if "" in own and (_ROOT / "cgroup.controllers").exists():
        folder = _ROOT / own[""].lstrip("/")
        enabled = (folder / "cgroup.subtree_control").read_text().split() if (folder / "cgroup.subtree_control").exists() else []
        if {"pids", "memory"} <= set(enabled) and os.access(folder, os.W_OK):
            return {"v2": folder}
    return None


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _sweep(parent: Path) -> None:
    """Remove the empty cgroups of sandboxes that ended (rmdir refuses a populated one)."""
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(_PREFIX)]
    except OSError:
        return
    for entry in entries:
        try:
            os.rmdir(entry.path)
        except OSError:
            pass


def _make(parents: dict[str, Path], name: str) -> Optional[dict[str, Path]]:
    made = {}
    try:
        for kind, parent in parents.items():
            _sweep(parent)
            folder = parent / name
            folder.mkdir()
            made[kind] = folder
        limit = memory_limit_mb() * 2**20
        if "v2" in made:
            _write(made["v2"] / "pids.max", str(PIDS_MAX))
            _write(made["v2"] / "memory.max", str(limit))
            with_swap = made["v2"] / "memory.swap.max"
            if with_swap.exists():
                _write(with_swap, "0")
        else:
            _write(made["pids"] / "pids.max", str(PIDS_MAX))
            _write(made["memory"] / "memory.limit_in_bytes", str(limit))
        return made
    except OSError:
        _remove(made)
        return None


def _remove(made: dict) -> None:
    for folder in made.values():
        try:
            os.rmdir(folder)
        except OSError:
            pass


def _new_cgroup(name: str) -> Optional[dict]:
    """A bounded cgroup called ``name`` under every controller's parent, or None where cgroups
    cannot be used here."""
    parents = _parents()
    return None if parents is None else _make(parents, name)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether sandboxes started from this process get cgroup bounds (tried once: a cgroup is made,
    bounded and removed)."""
    made = _new_cgroup(f"{_PREFIX}probe-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    if made is None:
        return False
    _remove(made)
    return True


def enter() -> bool:
    """Move this process (about to exec bwrap, or a child about to) into a new cgroup of
    :data:`PIDS_MAX` processes and :func:`memory_limit_mb` MiB. Returns whether it did; False where
    cgroups cannot be used here (nothing changed)."""
    made = _new_cgroup(f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    if made is None:
        return False
    try:
        for folder in made.values():
            _write(folder / "cgroup.procs", "0")  # "0": the writing process
    except OSError:
        return False
    return True
