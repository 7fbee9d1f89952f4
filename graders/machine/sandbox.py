"""The sandbox every process that runs learner code runs in: bubblewrap (``bwrap``) on Linux.

What a sandboxed process gets (:func:`bwrap_argv`):

- a minimal view of the host, read-only: the system's folders (:data:`SYSTEM_FOLDERS`: /usr, /etc,
  /sys, the /bin and /lib links), the book's checkout, Python's prefixes and the folders on its
  module search path (:func:`_needed_paths`); nothing else (no /run, /var, /home, /root, /srv, /mnt,
  /opt, runtime folder), so no service listening on a Unix socket there can be reached (connecting
  to a socket file needs no write access, only the file); the folders in ``hidden`` replaced by
  empty ones and the files there by an empty file, even inside a folder bound for the code (a
  course's data, :func:`course_data`: its gradebook and every student's submission, also where the
  course folder is, holds or lies in the checkout), and so is the instructor's TMPDIR when it is not
  /tmp (a grading run's work folder: kernels' keys and sockets); only the folders in ``writable``
  writable, the root itself read-only;
- a private ``/tmp`` of bounded size (``tmp_mb``), a private ``/dev`` with a bounded ``/dev/shm``
  (:data:`SHM_MB`; plus ``/dev/nvidia*`` when a GPU is to be used), its own ``/proc``;
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

import contextlib
import functools
import glob
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Optional, Sequence

__all__ = ["MODE_ENV", "COURSE_ENV", "course_config", "course_data", "course_hidden", "mode", "available", "enabled", "bwrap_argv", "limit_resources", "sandbox_env",
           "SandboxUnavailable", "describe", "python_argv", "set_parent_death_signal"]

MODE_ENV = "LORA_BOOK_SANDBOX"
MODES = ("auto", "required", "off")
#: Environment variables a sandboxed process keeps (all others, the secret included, are dropped).
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "PYTHONPATH", "PYTHONHASHSEED",
              "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
              "MKL_NUM_THREADS", "LORA_BOOK_GRADER_TIMEOUT", "LORA_BOOK_GRADER_CHILD", "JUPYTER_PATH",
              "PYDEVD_DISABLE_FILE_VALIDATION", "JPY_SESSION_NAME")
#: Set by the instructor's grading commands (``graders.course.autograde``) for the kernels they start:
#: the course roots (``os.pathsep``-separated) whose data (:func:`course_data`) every kernel hides.
#: Trusted configuration: what a sandbox hides never comes from a folder a student fills.
COURSE_ENV = "LORA_BOOK_COURSE_DIR"
#: The graders' fingerprint of a course, written by ``python -m graders.course fingerprint``
#: (``graders.course.jobs.FINGERPRINT_FILE`` is this name).
FINGERPRINT_NAME = ".lora_book_fingerprint.json"
#: Limits of a sandboxed process (and of every process it starts).
FILE_SIZE_MB = 64  # any one file it writes
TMP_MB = 256  # its private /tmp
SHM_MB = 64  # its /dev/shm (a RAM tmpfs like /tmp)
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
        from graders.machine import cgroups

        bounds = ("processes and memory bounded per sandbox by cgroups" if cgroups.available() else
                  "NO per-sandbox bound on processes and memory (no writable cgroup here: rlimits only, "
                  + ("which do not bound root's processes" if os.getuid() == 0 else "shared by this user's sandboxes")
                  + ")")
        return f"learner code ran sandboxed (bubblewrap: read-only files, no network, no secret, limits; {bounds})"
    why = "LORA_BOOK_SANDBOX=off" if mode() == "off" else "bubblewrap (bwrap) is not available here"
    return f"learner code ran UNSANDBOXED ({why}): it could read and write what this user can"


def _base_args() -> list[str]:
    """What every sandbox gets: the system's read-only folders, its own /proc, /dev (with a small
    /dev/shm) and namespaces, a read-only root (learner code can create nothing outside the folders
    bound writable and its private tmpfs)."""
    return [*_system_view(), "--proc", "/proc", "--dev", "/dev", "--size", str(SHM_MB * 2**20), "--tmpfs",
            "/dev/shm", "--unshare-all", "--die-with-parent", "--new-session"]


#: The host's folders every sandbox sees, read-only: the system's programs, libraries and settings.
#: Nothing else of the host (not /run, /var, /home, /root, /srv, /mnt, /opt, the runtime folder, the
#: instructor's TMPDIR), so no socket a service listens on there can be connected to.
SYSTEM_FOLDERS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys")


def _system_view() -> list[str]:
    args = []
    for folder in SYSTEM_FOLDERS:
        path = Path(folder)
        if path.is_symlink():  # merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(path), folder]
        elif path.is_dir():
            args += ["--ro-bind", folder, folder]
    return args


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
    root = str(Path(__file__).resolve().parents[2])
    return [sys.executable, "-I", "-c", _ISOLATED_BOOT, root, module, *args]


def course_config(course: Path) -> tuple[dict, dict]:
    """(CourseDirectory, Exchange) settings of the course's nbgrader_config.py, run as nbgrader
    itself runs it; empty dicts (nbgrader's defaults) without the file, traitlets, or a working config."""
    if not (Path(course) / "nbgrader_config.py").is_file():
        return {}, {}
    try:
        from traitlets.config.loader import PyFileConfigLoader

        config = PyFileConfigLoader("nbgrader_config.py", path=str(course)).load_config()
        return dict(config.CourseDirectory), dict(config.Exchange)
    except Exception:  # noqa: BLE001 (a broken config: nbgrader itself will say so)
        return {}, {}


def course_data(course: Path) -> list[Path]:
    """The paths of an nbgrader course's data no sandbox may read, absolute: the source, release,
    submitted, autograded, feedback and solution folders (the course's nbgrader_config.py, else
    nbgrader's defaults), the exchange, the SQLite gradebook and its side files (journal, WAL,
    shared memory), the graders' fingerprint, grades.csv, nbgrader's log and the config itself (a
    database URL may carry a password). Whether they exist or not (a hidden path that does not exist
    is skipped by :func:`bwrap_argv`)."""
    course = Path(course).resolve()
    cd, ex = course_config(course)
    get = lambda key, default: str(cd.get(key) or default)  # noqa: E731
    paths = [course / get(f"{key}_directory", key)
             for key in ("source", "release", "submitted", "autograded", "feedback", "solution")]
    paths.append(Path(str(ex.get("root") or "/srv/nbgrader/exchange")))
    db_url = get("db_url", "")
    db = course / "gradebook.db"
    if db_url.startswith("sqlite:///"):
        db = course / db_url[len("sqlite:///"):].split("?")[0]
    paths += [db, *(db.with_name(db.name + side) for side in ("-journal", "-wal", "-shm"))]
    if db != course / "gradebook.db":
        paths += [course / "gradebook.db", *((course / f"gradebook.db{side}") for side in ("-journal", "-wal", "-shm"))]
    paths += [course / name for name in (FINGERPRINT_NAME, "grades.csv", ".nbgrader.log", "nbgrader_config.py")]
    return list(dict.fromkeys(Path(os.path.abspath(p)) for p in paths))


def course_hidden(courses: Iterable[Path]) -> list[Path]:
    """What a sandbox hides of these course roots: each root (but "/") and its :func:`course_data`.
    Pass it as ``hidden`` to :func:`bwrap_argv`, which hides them even inside the checkout (a root
    that is the checkout keeps its other entries: the code)."""
    hidden: list[Path] = []
    for course in courses:
        course = Path(course).resolve()
        hidden += [*([course] if course != Path("/") else []), *course_data(course)]
    return list(dict.fromkeys(hidden))


def trusted_courses() -> list[Path]:
    """The course roots of :data:`COURSE_ENV` (set by the grading commands), absolute."""
    value = os.environ.get(COURSE_ENV, "")
    return [Path(p).resolve() for p in value.split(os.pathsep) if p and os.path.isabs(p)]


def bwrap_argv(command: Sequence[str], *, writable: Iterable[Path] = (), hidden: Iterable[Path] = (),
               readable: Iterable[Path] = (), cwd: Optional[Path] = None, gpu: bool = False,
               tmp_mb: int = TMP_MB, env: Optional[dict] = None, share_net: bool = False,
               scratch: Iterable[tuple[Path, int]] = ()) -> list[str]:
    """The argv that runs ``command`` in the sandbox.

    Args:
        command: the program and its arguments.
        writable: folders bound read-write (mounted after ``hidden``, so one may sit inside a hidden one).
        hidden: folders replaced by empty read-only ones (e.g. the course folder), files by an
            empty one (a gradebook), even inside a folder bound for the code (mounted after it); a
            hidden folder that is itself bound for the code (a course root that is the checkout)
            keeps its entries that are not hidden (bound back; files made there later do not show);
            paths that do not exist are skipped.
        readable: folders inside a hidden one bound back read-only.
        cwd: the working directory inside (default: /tmp).
        gpu: bind every /dev/nvidia* device (CUDA needs them; nothing else of the host's /dev).
        tmp_mb: size of the private /tmp in MiB.
        env: the environment inside (default :func:`sandbox_env`); nothing else passes.
        share_net: keep the host's network (only a kernel whose client speaks TCP needs it).
        scratch: (folder, MiB) pairs: each folder replaced by a writable tmpfs of that size, whose
            writes never reach the host (bind what it should show with ``readable``).
    Raises:
        FileNotFoundError: bwrap is not installed.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise FileNotFoundError("bwrap (package bubblewrap) is not installed")
    args = [bwrap, *_base_args(), *(["--share-net"] if share_net else [])]
    # Mounts nested in one another are made outer first, whatever their kind: a folder bound into a
    # hidden one (a kernel's own files in the run's work folder) shows, and a path hidden inside a
    # bound one (a course's data inside the checkout) stays hidden. At equal depth: the code's
    # binds, then hide (a course root that is the checkout is hidden, its code bound back), then
    # the rest (bwrap: a mount given later covers one given earlier).
    hidden = [Path(os.path.abspath(p)) for p in hidden]
    for path in _tmp_dirs_to_hide():
        if path not in hidden:
            hidden.append(path)
    hidden = [p for p in dict.fromkeys(hidden) if p != Path("/") and (p.is_dir() or p.exists())]
    needed = _needed_paths()
    # a hidden folder that is the code's (a course root that is the checkout): its entries that are
    # not hidden are bound back
    back = [e for h in hidden if h in needed and h.is_dir() for e in sorted(h.iterdir()) if e not in hidden]
    binds = [*needed, *back, *(Path(p) for p in (*readable, *writable))]

    def covered(p: Path) -> bool:  # inside a hidden folder, and no bind inside that one shows it again
        return any(p != h and p.is_relative_to(h) and h.is_dir() and not any(
            p.is_relative_to(b) and b != h and b.is_relative_to(h) for b in binds) for h in hidden)
    hidden = [p for p in hidden if not covered(p)]
    folders = [p for p in hidden if p.is_dir()]
    mounts = [(Path("/tmp"), 0, ["--size", str(tmp_mb * 2**20), "--tmpfs", "/tmp"])]
    mounts += [(p, 0, ["--ro-bind", str(p), str(p)]) for p in needed]
    mounts += [(p, 1, ["--tmpfs", str(p)]) for p in folders if p != Path("/tmp")]
    # a file: an empty one in its place (/dev/null, bound read-only and without device access)
    mounts += [(p, 1, ["--ro-bind", "/dev/null", str(p)]) for p in hidden if not p.is_dir()]
    mounts += [(e, 2, _bind_back(e)) for e in back]
    mounts += [(Path(p), 2, ["--size", str(mb * 2**20), "--tmpfs", str(p)]) for p, mb in scratch]
    mounts += [(Path(p), 3, ["--ro-bind", str(p), str(p)]) for p in readable]
    mounts += [(Path(p), 4, ["--bind", str(p), str(p)]) for p in writable]
    for _, _, mount in sorted(mounts, key=lambda m: (len(m[0].parts), m[1])):
        args += mount
    for path in folders:  # after the binds: bwrap creates their mount points inside the empty folder
        if path != Path("/tmp"):
            args += ["--remount-ro", str(path)]
    args += ["--remount-ro", "/"]
    if gpu:
        for dev in sorted(glob.glob("/dev/nvidia*")):
            args += ["--dev-bind", dev, dev]
    args += ["--clearenv"]
    for k, v in (env if env is not None else sandbox_env()).items():
        args += ["--setenv", k, str(v)]
    args += ["--chdir", str(cwd or "/tmp"), "--", *command]
    return args


def _bind_back(entry: Path) -> list[str]:
    """Mount an entry of a hidden folder back as it is on the host: a link as the same link (never
    followed on the host), anything else bound read-only."""
    if entry.is_symlink():
        return ["--symlink", os.readlink(entry), str(entry)]
    return ["--ro-bind", str(entry), str(entry)]


def _tmp_dirs_to_hide() -> list[Path]:
    """The instructor's temporary folder (TMPDIR: the grading run's work folder, every kernel's
    connection file and sockets) when it is not /tmp (which every sandbox replaces with its own)."""
    tmp = Path(tempfile.gettempdir()).resolve()
    return [] if tmp == Path("/tmp") else [tmp]


def _needed_paths() -> list[Path]:
    """Folders outside :data:`SYSTEM_FOLDERS` that a sandboxed Python needs, bound read-only: the
    book's checkout, Python's prefixes and the folders on its module search path; outermost only."""
    root = Path(__file__).resolve().parents[2]
    here = os.getcwd()  # on sys.path when run as `python -m` or a script: never needed, never bound
    candidates = [root, Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix), Path(sys.executable).parent,
                  Path(sys.executable).resolve().parent.parent, *(Path(p) for p in sys.path if p and p != here)]
    system = [Path(f) for f in SYSTEM_FOLDERS]
    # both the path as named and where its links lead (a virtual environment's python is a link)
    named = {Path(os.path.abspath(c)) for c in candidates if c.is_absolute() and c.exists()}
    found = sorted(named | {c.resolve() for c in named}, key=lambda p: (len(p.parts), str(p)))
    kept: list[Path] = []
    for p in found:
        if p != Path("/") and not any(p.is_relative_to(k) for k in kept + system):
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


def set_parent_death_signal() -> None:
    """Linux: SIGKILL this process when its parent dies (a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
