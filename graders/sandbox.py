"""The sandbox every process that runs learner code runs in: bubblewrap (``bwrap``) on Linux.

What a sandboxed process gets (:func:`bwrap_argv`):

- the whole file system read-only (``--ro-bind / /``), with the folders in ``hidden`` replaced by
  empty ones (a course's gradebook and other students' submissions) and only the folders in
  ``writable`` writable;
- a private ``/tmp`` of bounded size (``tmp_mb``), a private ``/dev`` (plus ``/dev/nvidia*`` when
  a GPU is to be used), its own ``/proc``;
- no network, its own PID, IPC, UTS and user namespaces (``--unshare-all``): it sees no process of
  the host, and every process it starts dies with it (``--die-with-parent``: when the process that
  started bwrap dies, the sandbox's first process gets SIGKILL, and with it the namespace);
- an environment rebuilt from a short allow-list (:data:`PASSED_ENV`): the instructor's secret
  (``LORA_BOOK_SECRET``) never enters it;
- resource limits (:func:`limit_resources`, applied before exec and inherited): file size, process
  count, core dumps, and on the CPU address space.

Policy (:func:`mode`): ``LORA_BOOK_SANDBOX=auto`` (default) sandboxes when bwrap works here and runs
unsandboxed otherwise (self-study on a laptop, macOS); ``required`` refuses to run learner code
without it (the instructor commands that grade real submissions set it unless ``--unsandboxed``);
``off`` never sandboxes.

Source: bubblewrap (github.com/containers/bubblewrap), the sandbox of Flatpak; the design follows
the grading sandboxes of online judges (read-only root, private tmpfs, no network, rlimits).
"""
from __future__ import annotations

import functools
import glob
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

__all__ = ["MODE_ENV", "mode", "available", "enabled", "bwrap_argv", "limit_resources", "sandbox_env",
           "SandboxUnavailable", "describe", "python_argv"]

MODE_ENV = "LORA_BOOK_SANDBOX"
MODES = ("auto", "required", "off")
#: Environment variables a sandboxed process keeps (all others, the secret included, are dropped).
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "PYTHONPATH", "PYTHONHASHSEED",
              "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
              "MKL_NUM_THREADS", "LORA_BOOK_GRADER_TIMEOUT", "LORA_BOOK_GRADER_CHILD", "JUPYTER_PATH",
              "PYDEVD_DISABLE_FILE_VALIDATION", "JPY_SESSION_NAME")
#: Limits of a sandboxed process (and of every process it starts).
FILE_SIZE_MB = 64  # any one file it writes
TMP_MB = 256  # its private /tmp
EXTRA_PROCESSES = 256  # processes it may start, beyond what its user runs already
EXTRA_ADDRESS_SPACE_GB = 12  # on the CPU: address space beyond what the process maps at its start


class SandboxUnavailable(RuntimeError):
    """``LORA_BOOK_SANDBOX=required`` but bubblewrap cannot run here."""


def mode() -> str:
    """The sandbox policy: ``auto``, ``required`` or ``off`` (``LORA_BOOK_SANDBOX``).

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r}: expected one of {', '.join(MODES)}")
    return value


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when bwrap is installed and can create its namespaces here (tried once per process)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None or not sys.platform.startswith("linux"):
        return False
    try:
        proc = subprocess.run([bwrap, *_base_args(), "--", "/bin/true"], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def enabled() -> bool:
    """Whether learner code runs sandboxed under the current policy.

    Raises:
        SandboxUnavailable: the policy is ``required`` and bwrap cannot run here.
    """
    m = mode()
    if m == "off":
        return False
    if available():
        return True
    if m == "required":
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is required to grade learner code here but cannot run: install the "
            "Debian/Ubuntu package 'bubblewrap' (apt-get install bubblewrap), or pass --unsandboxed "
            "to grade without a sandbox (then learner code can read and write what you can)")
    return False


def describe() -> str:
    """One line for reports: how learner code runs under the current policy."""
    try:
        on = enabled()
    except SandboxUnavailable as exc:
        return f"learner code cannot run: {exc}"
    if on:
        return "learner code ran sandboxed (bubblewrap: read-only files, no network, no secret, limits)"
    why = "LORA_BOOK_SANDBOX=off" if mode() == "off" else "bubblewrap (bwrap) is not available here"
    return f"learner code ran UNSANDBOXED ({why}): it could read and write what this user can"


def _base_args() -> list[str]:
    return ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-all",
            "--die-with-parent", "--new-session"]


def sandbox_env(extra: Optional[dict] = None) -> dict:
    """The environment of a sandboxed process: :data:`PASSED_ENV` from ours, HOME=/tmp, ``extra``."""
    env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    env["HOME"] = "/tmp"
    env["TMPDIR"] = "/tmp"
    env.update(extra or {})
    env.pop("LORA_BOOK_SECRET", None)
    return env


#: Run by ``python -I -c``: the module search path of an isolated interpreter (no current folder,
#: no script folder, no user site, no PYTHON* variables), plus the book's checkout and the absolute
#: PYTHONPATH folders that exist when it starts, then the module as ``python -m`` would.
_ISOLATED_BOOT = (
    "import os, runpy, sys\n"
    "extra = [sys.argv[1], *os.environ.get('PYTHONPATH', '').split(os.pathsep)]\n"
    "sys.path += [p for p in dict.fromkeys(extra) if os.path.isabs(p) and os.path.isdir(p) and p not in sys.path]\n"
    "sys.argv = sys.argv[2:]\n"
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")


def python_argv(module: str, *args: str) -> list[str]:
    """``python -m module args`` in isolated mode (``-I``): nothing on the module search path that
    the process (or learner code in a child it forks) can write, so no module planted in a working
    folder or in /tmp is ever imported in its place."""
    root = str(Path(__file__).resolve().parents[1])
    return [sys.executable, "-I", "-c", _ISOLATED_BOOT, root, module, *args]


def bwrap_argv(command: Sequence[str], *, writable: Iterable[Path] = (), hidden: Iterable[Path] = (),
               readable: Iterable[Path] = (), cwd: Optional[Path] = None, gpu: bool = False,
               tmp_mb: int = TMP_MB, env: Optional[dict] = None, share_net: bool = False) -> list[str]:
    """The argv that runs ``command`` in the sandbox.

    Args:
        command: the program and its arguments.
        writable: folders bound read-write (mounted after ``hidden``, so one may sit inside a hidden one).
        hidden: folders replaced by empty read-only ones (e.g. the course folder).
        readable: folders inside a hidden one bound back read-only.
        cwd: the working directory inside (default: /tmp).
        gpu: bind every /dev/nvidia* device (CUDA needs them; nothing else of the host's /dev).
        tmp_mb: size of the private /tmp in MiB.
        env: the environment inside (default :func:`sandbox_env`); nothing else passes.
        share_net: keep the host's network (only a kernel whose client speaks TCP needs it).
    Raises:
        FileNotFoundError: bwrap is not installed.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise FileNotFoundError("bwrap (package bubblewrap) is not installed")
    args = [bwrap, *_base_args(), *(["--share-net"] if share_net else []),
            "--size", str(tmp_mb * 2**20), "--tmpfs", "/tmp"]
    # the private /tmp covers the host's: bring back, read-only, what the process needs to run
    # that lives there (a checkout or virtual environment under /tmp, e.g. a CI clone)
    for path in _needed_under_tmp():
        args += ["--ro-bind", str(path), str(path)]
    hidden = list(hidden)
    for path in hidden:
        args += ["--tmpfs", str(path)]
    for path in readable:
        args += ["--ro-bind", str(path), str(path)]
    for path in writable:
        args += ["--bind", str(path), str(path)]
    for path in hidden:  # after the binds: bwrap creates their mount points inside the empty folder
        args += ["--remount-ro", str(path)]
    if gpu:
        for dev in sorted(glob.glob("/dev/nvidia*")):
            args += ["--dev-bind", dev, dev]
    args += ["--clearenv"]
    for k, v in (env if env is not None else sandbox_env()).items():
        args += ["--setenv", k, str(v)]
    args += ["--chdir", str(cwd or "/tmp"), "--", *command]
    return args


def _needed_under_tmp() -> list[Path]:
    """The book's checkout, Python's prefixes and sys.path entries that lie under /tmp, outermost
    only."""
    root = Path(__file__).resolve().parents[1]
    candidates = [root, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).parent,
                  *(Path(p) for p in sys.path if p)]
    tmp = Path("/tmp")
    under = sorted({c.resolve() for c in candidates if c.exists() and c.resolve().is_relative_to(tmp)
                    and c.resolve() != tmp}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for p in under:
        if not any(p.is_relative_to(k) for k in kept):
            kept.append(p)
    return kept


def _processes_of_this_user() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


def limit_resources(cpu_only: bool = True) -> None:
    """Apply the sandbox's rlimits to this process (call it in the child before exec, or in a fork).

    RLIMIT_FSIZE: no file over :data:`FILE_SIZE_MB`; RLIMIT_CORE: no core dumps; RLIMIT_NPROC: at
    most :data:`EXTRA_PROCESSES` more processes of this user (a fork bomb stops there); RLIMIT_AS
    (``cpu_only``; CUDA maps far more address space than it uses): :data:`EXTRA_ADDRESS_SPACE_GB`
    beyond what is mapped now. Limits only go down: one already lower is kept.
    """
    def lower(which: int, value: int) -> None:
        soft, hard = resource.getrlimit(which)
        cap = value if hard == resource.RLIM_INFINITY else min(value, hard)
        if soft == resource.RLIM_INFINITY or soft > cap:
            resource.setrlimit(which, (cap, cap))

    lower(resource.RLIMIT_FSIZE, FILE_SIZE_MB * 2**20)
    lower(resource.RLIMIT_CORE, 0)
    if sys.platform.startswith("linux"):
        lower(resource.RLIMIT_NPROC, _processes_of_this_user() + EXTRA_PROCESSES)
        if cpu_only:
            with open("/proc/self/statm") as f:
                mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            lower(resource.RLIMIT_AS, mapped + EXTRA_ADDRESS_SPACE_GB * 2**30)
