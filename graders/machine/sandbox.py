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
- a private ``/tmp`` of bounded size (``tmp_mb``), a private read-only ``/dev`` with a bounded
  ``/dev/shm`` (:data:`SHM_MB`; plus ``/dev/nvidia*`` when a GPU is to be used), its own ``/proc``;
- no network, its own PID, IPC, UTS and user namespaces (``--unshare-all``): it sees no process of
  the host, and every process it starts dies with it (``--die-with-parent``: when the process that
  started bwrap dies, the sandbox's first process gets SIGKILL, and with it the namespace);
- an environment rebuilt from a short allow-list (:data:`PASSED_ENV`): the instructor's secret
  (``LORA_BOOK_SECRET``) never enters it;
- resource limits (:func:`limit_resources`, applied before exec and inherited): file size, process
  count, core dumps, and on the CPU address space;
- graded as root (issue #31): no capability (``--cap-drop ALL``: bwrap started by root keeps them
  all by default, and with CAP_SYS_ADMIN in the sandbox's namespaces learner code could unmount
  what hides a course's data or remount ``/usr`` writable on the host), the host-wide entries of
  /proc read-only (:func:`_root_proc_cover`: uid 0 could write the sysctls), no nested user namespace
  (``--disable-userns``, where bwrap and the kernel support it: its root would regain
  CAP_DAC_OVERRIDE over root's files), and every entry of the folders bound for the code and the
  system that other users could not read masked (:func:`_root_masks`): uid 0 inside is still the
  owner of root's files, so without the masks it would read ``/etc/shadow`` or a 0600 file of the
  checkout; and, being that owner, it could chmod the host's device nodes bound into its /dev: a
  seccomp filter (:func:`_seccomp_program`, given to bwrap, which applies it to its own init and
  to the command) makes chmod, chown and the extended-attribute calls succeed without effect.

Policy (:func:`mode`): ``LORA_BOOK_SANDBOX=auto`` (default) sandboxes when bwrap works here and runs
unsandboxed otherwise (self-study on a laptop, macOS); ``required`` refuses to run learner code
without it (the instructor commands that grade real submissions set it unless ``--unsandboxed``);
``off`` never sandboxes.

Source: bubblewrap (github.com/containers/bubblewrap), the sandbox of Flatpak; the design follows
the grading sandboxes of online judges (read-only root, private tmpfs, no network, rlimits).
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import glob
import json
import os
import platform
import resource
import shlex
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterable, Optional, Sequence

__all__ = ["MODE_ENV", "COURSE_ENV", "course_config", "course_data", "course_hidden", "mode", "available", "enabled", "bwrap_argv", "limit_resources", "sandbox_env",
           "SandboxUnavailable", "describe", "python_argv", "set_parent_death_signal", "MASKS_ENV", "share_masks"]

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
#: Graded as root: a folder with more masked entries than this (and at least half of its entries
#: masked), or all of whose entries (two or more) are masked, is masked as a whole (:func:`_collapse`).
MASKS_PER_FOLDER = 16
#: Graded as root: at most this many masks in one sandbox's argv (past it the folders are masked
#: more coarsely; a host that still needs more refuses to sandbox rather than show root's files).
MAX_MASKS = 2048
#: Set by a grading run for the processes it starts (:func:`share_masks`: nbgrader's kernel
#: wrappers): a JSON file, in a folder only root can write, of the masks found per folder as root;
#: they read it instead of scanning again.
MASKS_ENV = "LORA_BOOK_SANDBOX_MASKS"


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
        root = ("; as root: no capability, what other users cannot read masked" if os.geteuid() == 0 else "")
        return ("learner code ran sandboxed (bubblewrap: read-only files, no network, no secret, limits; "
                f"{bounds}{root})")
    why = "LORA_BOOK_SANDBOX=off" if mode() == "off" else "bubblewrap (bwrap) is not available here"
    return f"learner code ran UNSANDBOXED ({why}): it could read and write what this user can"


def _base_args() -> list[str]:
    """What every sandbox gets: the system's read-only folders, its own /proc, /dev (with a small
    /dev/shm) and namespaces, a read-only root (learner code can create nothing outside the folders
    bound writable and its private tmpfs); as root, no capability and no nested user namespace
    (:func:`_root_args`)."""
    return [*_system_view(), "--proc", "/proc", *_root_proc_cover(), "--dev", "/dev", "--size", str(SHM_MB * 2**20),
            "--tmpfs", "/dev/shm", "--unshare-all", *_root_args(), "--die-with-parent", "--new-session"]


#: Entries of /proc that change the whole host, not the sandbox's own processes: the sysctls
#: (``kernel.core_pattern`` names a program the kernel runs as root on the host), the GPU driver's
#: switches (``/proc/driver/nvidia/suspend``), ACPI wake-up, ... Their files belong to kernel uid 0
#: and most check no capability, so a sandbox started by root could write them: bwrap covers
#: ``/proc/sys`` read-only only where ``access(W_OK)`` says root may write it, and for /proc/sys
#: the kernel says no (a folder there refuses writes even to root) while its files say yes.
_PROC_GLOBAL = ("sys", "driver", "acpi", "fs", "scsi", "tty", "dynamic_debug", "sysrq-trigger", "mtrr")


def _root_proc_cover() -> list[str]:
    """Started by root: each entry of :data:`_PROC_GLOBAL` that exists, and every other file at
    the top of /proc that has a write bit, bound read-only over the sandbox's /proc (the host's
    view of them: the same global state). What stays writable is the sandbox's own processes'
    (``/proc/<pid>``) and ``/proc/pressure`` (writable by any user)."""
    if os.geteuid() != 0:
        return []
    names = set(_PROC_GLOBAL)
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            with contextlib.suppress(OSError):
                if (not entry.name.isdigit() and entry.is_file(follow_symlinks=False)
                        and entry.stat(follow_symlinks=False).st_mode & 0o222):
                    names.add(entry.name)
    args = []
    for name in sorted(names):
        path = f"/proc/{name}"
        if os.path.lexists(path) and not os.path.islink(path):
            args += ["--ro-bind", path, path]
    return args


@functools.lru_cache(maxsize=None)
def _root_args() -> tuple[str, ...]:
    """bwrap's options for a sandbox started by root (none otherwise).

    ``--cap-drop ALL``: bwrap run by uid 0 keeps every capability by default (bubblewrap's manual:
    "--cap-drop ... when running as privileged user"), so the sandbox's first process held
    CAP_SYS_ADMIN over its own mount namespace: it could unmount the tmpfs that hides a course's
    data (another student's submission shows again) or remount a bound folder writable (``/usr``
    of the host). Without capabilities uid 0 can change no mount; it stays the owner of root's
    files (see :func:`_root_masks`).

    ``--unshare-user --disable-userns`` (bwrap >= 0.8.0, a kernel with user namespaces): no nested
    user namespace, whose root would hold CAP_DAC_OVERRIDE over the files of root (uid 0 is mapped
    there); tried once, left out where bwrap refuses it (the masks still hold: a nested namespace
    cannot unmount them, its mounts are locked).
    """
    if os.geteuid() != 0:
        return ()
    drop = ("--cap-drop", "ALL")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return drop
    try:
        proc = subprocess.run([bwrap, *_system_view(), "--proc", "/proc", "--dev", "/dev", "--unshare-all",
                               "--unshare-user", "--disable-userns", *drop, "--", "/bin/true"],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return drop
    return (*drop, "--unshare-user", "--disable-userns") if proc.returncode == 0 else drop


#: Syscalls that change a file's mode, owner or extended attributes (ACLs), per machine: graded as
#: root, uid 0 inside the sandbox owns the host's device nodes that bwrap binds into its /dev
#: (/dev/null, /dev/zero, /dev/tty, /dev/urandom, /dev/nvidia*), and owning a file needs no
#: capability to chmod it, so learner code could have changed the host's /dev/null (red-team
#: review of this session). They succeed without effect (SECCOMP_RET_ERRNO with errno 0): a
#: program that copies a file's mode (shutil.copy) or GNU ld making its output executable goes on,
#: and nothing of the host changes. (x86_64 / aarch64 numbers from the kernel's syscall tables.)
_NO_EFFECT_SYSCALLS = {
    # chmod fchmod chown fchown lchown fchownat fchmodat fchmodat2, setxattr lsetxattr fsetxattr
    # removexattr lremovexattr fremovexattr setxattrat removexattrat
    "x86_64": (0xC000003E, (90, 91, 92, 93, 94, 260, 268, 452, 188, 189, 190, 197, 198, 199, 463, 466)),
    # fchmod fchmodat fchownat fchown fchmodat2, setxattr lsetxattr fsetxattr removexattr
    # lremovexattr fremovexattr setxattrat removexattrat (no legacy chmod/chown there)
    "aarch64": (0xC00000B7, (52, 53, 54, 55, 452, 5, 6, 7, 14, 15, 16, 463, 466)),
}
#: Refused (EPERM) everywhere: io_uring (setup, enter, register; the same numbers on both
#: machines), whose requests include setxattr and would not pass through the filter above.
_REFUSED_SYSCALLS = (425, 426, 427)


def _seccomp_program(machine: str) -> Optional[bytes]:
    """The classic-BPF seccomp program for ``machine`` (platform.machine()), or None where the
    syscall numbers are not known here: the listed syscalls return 0 without effect, io_uring's and
    a syscall of another architecture (x86's 32-bit or x32 entry points, 32-bit Arm) return EPERM,
    every other syscall runs."""
    if machine not in _NO_EFFECT_SYSCALLS:
        return None
    arch, numbers = _NO_EFFECT_SYSCALLS[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, no_effect, eperm = 0x7FFF0000, 0x00050000, 0x00050000 | 1  # RET_ALLOW, RET_ERRNO | errno
    n, m = len(numbers), len(_REFUSED_SYSCALLS)  # a jump goes to its index + 1 + jt
    prog = [(ld, 0, 0, 4),                       # 0: seccomp_data.arch
            (jeq, 1, 0, arch),                   # 1: this machine's: to 3
            (ret, 0, 0, eperm),                  # 2: another architecture's entry point
            (ld, 0, 0, 0),                       # 3: seccomp_data.nr
            (jge, n + m + 2, 0, 0x40000000)]     # 4: x32's numbers: to the last eperm
    prog += [(jeq, n + m - i, 0, nr) for i, nr in enumerate(numbers)]  # 5 + i: to no_effect
    prog += [(jeq, m - j + 1, 0, nr) for j, nr in enumerate(_REFUSED_SYSCALLS)]  # to eperm
    prog += [(ret, 0, 0, allow), (ret, 0, 0, no_effect), (ret, 0, 0, eperm)]
    return b"".join(struct.pack("=HBBI", *f) for f in prog)


#: The seccomp program of this process (a memfd it keeps open, not closed on exec), read by each
#: bwrap it starts through ``/proc/<pid>/fd/<n>``: every open is a new file description at offset 0
#: (bwrap reads the descriptor to its end), and no caller has to pass a descriptor to its child.
_SECCOMP_FD: dict[int, int] = {}


def _seccomp_source() -> Optional[str]:
    """``/proc/<pid>/fd/<n>`` holding this machine's filter, or None (not root, an unknown machine,
    no memfd). One memfd per process (a fork makes its own: its pid is another)."""
    if os.geteuid() != 0:
        return None
    pid = os.getpid()
    if pid not in _SECCOMP_FD:
        prog = _seccomp_program(platform.machine())
        if prog is None or not hasattr(os, "memfd_create"):
            return None
        # no MFD_CLOEXEC: a process that execs into bwrap (the kernel wrapper) keeps it; sealed, so no
        # process it reaches (bwrap passes inherited descriptors on) can change the program
        fd = os.memfd_create("lora-book-seccomp", os.MFD_ALLOW_SEALING)
        os.write(fd, prog)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    | fcntl.F_SEAL_WRITE)
        _SECCOMP_FD[pid] = fd
    return f"/proc/{pid}/fd/{_SECCOMP_FD[pid]}"


def _seccomp_shell(source: str) -> list[str]:
    """What goes before bwrap's argv so that its ``--seccomp 9`` reads ``source``: a shell that opens
    it as descriptor 9 and execs the rest (``sh -c 'exec "$@" 9<FILE' sh bwrap ...``)."""
    return ["/bin/sh", "-c", f'exec "$@" 9<{shlex.quote(source)}', "sh"]


@functools.lru_cache(maxsize=None)
def _seccomp_works() -> bool:
    """Whether bwrap here takes the filter (``--seccomp``: a kernel with seccomp filters), tried once."""
    source, bwrap = _seccomp_source(), shutil.which("bwrap")
    if source is None or bwrap is None:
        return False
    try:
        proc = subprocess.run([*_seccomp_shell(source), bwrap, *_system_view(), "--proc", "/proc", "--dev", "/dev",
                               "--unshare-all", *_root_args(), "--seccomp", "9", "--", "/bin/true"],
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def _with_seccomp(args: list[str]) -> list[str]:
    """bwrap's argv ``args`` ([bwrap, options..., "--", command...]) with the filter (graded as root,
    where it works): bwrap applies it to its own init (pid 1 inside, which learner code could
    otherwise drive through ptrace or /proc/1/mem) and to the command. Unchanged otherwise."""
    if not _seccomp_works():
        return args
    cut = args.index("--")
    return [*_seccomp_shell(_seccomp_source()), *args[:cut], "--seccomp", "9", *args[cut:]]


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


#: ``find``'s test for the entries of a folder bound for the code that root's sandbox masks: a
#: folder other users cannot enter (printed ``d``, not descended), a file other users cannot read
#: though its owner or group can (``f``), a socket or fifo other users cannot write though its
#: owner or group can (connecting to a socket needs only that); links are never followed.
_FIND_TEST = ["-mindepth", "1", "(", "-type", "d", "!", "-perm", "-o=x", "-prune", "-printf", "d %p\\0", ")", "-o",
              "(", "!", "-type", "d", "!", "-type", "l", "(", "!", "-perm", "-o=r", "-perm", "/u=r,g=r", "-o",
              "(", "-type", "s", "-o", "-type", "p", ")", "!", "-perm", "-o=w", "-perm", "/u=w,g=w", ")",
              "-printf", "f %p\\0", ")"]


def _unreadable_walk(tree: str) -> dict[str, bool]:
    """What :data:`_FIND_TEST` finds under ``tree`` ({path: is a folder}), in Python (no ``find``)."""
    found: dict[str, bool] = {}
    todo = [tree]
    while todo:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:
                continue
            if stat.S_ISLNK(mode):
                continue
            if stat.S_ISDIR(mode):
                if mode & stat.S_IXOTH:
                    todo.append(entry.path)
                else:
                    found[entry.path] = True
            elif (not mode & stat.S_IROTH and mode & (stat.S_IRUSR | stat.S_IRGRP)) or (
                    (stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode)) and not mode & stat.S_IWOTH
                    and mode & (stat.S_IWUSR | stat.S_IWGRP)):
                found[entry.path] = False
    return found


def _collapse(tree: str, masks: dict[str, bool], per: int = MASKS_PER_FOLDER, half: bool = True) -> dict[str, bool]:
    """Fewer masks for the same files: a folder of ``tree`` (never ``tree`` itself) with more than
    ``per`` masked entries (and, with ``half``, at least half of its entries masked), or all of
    whose two or more entries are masked, is masked itself instead; repeated up the tree. Hides
    readable entries of such a folder too (``/sys/kernel/slab``: 7000 root-only files of 200
    caches, one mask)."""
    masks = dict(masks)
    while True:
        counts = collections.Counter(os.path.dirname(m) for m in masks)
        whole = []
        for folder, n in counts.items():
            if not folder.startswith(tree.rstrip("/") + "/"):
                continue
            try:
                entries = len(os.listdir(folder))
            except OSError:
                continue
            if (n >= entries >= 2) or (n > per and (not half or 2 * n >= entries)):
                whole.append(folder)
        if not whole:
            return masks
        for folder in whole:
            masks[folder] = True
        folders = {m for m, is_dir in masks.items() if is_dir}

        def inside_one(m: str) -> bool:
            parent = os.path.dirname(m)
            while len(parent) > len(tree):
                if parent in folders:
                    return True
                parent = os.path.dirname(parent)
            return False
        masks = {m: is_dir for m, is_dir in masks.items() if not inside_one(m)}


#: The masks found per folder in this process (:func:`_scanned`): scanned once, so a root-only file
#: made in a bound folder after this process's first sandbox does not show as masked until the next.
_SCANNED: dict[str, dict[str, bool]] = {}
_SCAN_LOCK = threading.Lock()  # the re-grade builds sandboxes from several threads


def _read_shared() -> dict[str, dict[str, bool]]:
    """The masks of :data:`MASKS_ENV`'s file, if it and its folder belong to this user and only it
    can write them; {} otherwise."""
    path = os.environ.get(MASKS_ENV, "")
    try:
        for p in (os.path.dirname(path), path):
            st = os.lstat(p)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                return {}
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            data = json.load(f)
        return {str(t): {str(m): bool(d) for m, d in found} for t, found in data["trees"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _scanned(trees: Sequence[str]) -> dict[str, dict[str, bool]]:
    """The masks of each folder in ``trees`` ({path: is a folder}, collapsed): from this process's
    cache, else from the file a grading run wrote (:func:`share_masks`), else scanned (one ``find``
    per folder, side by side)."""
    with _SCAN_LOCK:
        return _scanned_locked(trees)


def _scanned_locked(trees: Sequence[str]) -> dict[str, dict[str, bool]]:
    missing = [t for t in dict.fromkeys(trees) if t not in _SCANNED]
    if missing:
        shared = _read_shared()
        for t in missing:
            if t in shared:
                _SCANNED[t] = shared[t]
        missing = [t for t in missing if t not in _SCANNED]
    if missing:
        find = shutil.which("find")
        procs = {}
        for t in missing:
            with contextlib.suppress(OSError):
                if find:
                    procs[t] = subprocess.Popen([find, "-H", t, *_FIND_TEST], stdin=subprocess.DEVNULL,
                                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        for t in missing:
            proc = procs.get(t)
            if proc is None:
                found = _unreadable_walk(t)
            else:
                out = proc.communicate()[0]
                found = {e[2:].decode(errors="surrogateescape"): e[:1] == b"d" for e in out.split(b"\0") if e}
            _SCANNED[t] = _collapse(t, found)
    return {t: _SCANNED[t] for t in trees}


def _under(path: str, folders: Iterable[str]) -> bool:
    """``path`` is one of ``folders`` or inside one."""
    return any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders)


def _root_masks(trees: Sequence[Path], hidden: Sequence[Path], shown: Sequence[Path],
                explicit: Sequence[Path]) -> list[tuple[str, bool]]:
    """What a sandbox started by root masks, [(path, is a folder)]: every entry of ``trees`` (the
    system's folders and those bound for the code) that other users could not read (an empty
    read-only tmpfs over a folder they cannot enter, an unreadable device node over a file: opening
    it fails), so that uid 0 inside, the owner of root's files, reads only what any user reads.
    Leaves out what ``explicit`` binds show as they are (the kernel's connection file, its
    notebook's files, work folders) and what ``hidden`` already hides (unless a bind of ``shown``
    inside that hidden folder shows it again).

    Raises:
        SandboxUnavailable: a mask would hide what the sandbox's Python needs to start (a checkout
            or an environment other users cannot read: ``chmod -R o+rX`` it), or the host needs
            more than :data:`MAX_MASKS`.
    """
    scanned = _scanned([str(t) for t in trees])
    explicit_s = [str(p) for p in explicit]
    hidden_s = [str(h) for h in hidden]
    shown_s = [str(b) for b in shown]

    def keep(m: str) -> bool:
        if _under(m, explicit_s):
            return False
        for h in hidden_s:
            if _under(m, [h]) and not any(b != h and _under(b, [h]) and _under(m, [b]) for b in shown_s):
                return False
        return True
    per, half = MASKS_PER_FOLDER, True
    while True:
        masks = {m: d for found in scanned.values() for m, d in found.items() if keep(m)}
        if len(masks) <= MAX_MASKS:
            break
        if per < 1:
            raise SandboxUnavailable(
                f"graded as root, the folders bound into the sandbox hold more than {MAX_MASKS} entries "
                "other users cannot read: grade as an ordinary user")
        per, half = per // 2, False
        scanned = {t: _collapse(t, found, per, half) for t, found in scanned.items()}
    # what went since the scan is skipped (bwrap fails on a mask with nothing under it); a file
    # that became a folder or the reverse is masked as what it is now
    now = {}
    for m in masks:
        with contextlib.suppress(OSError):
            now[m] = stat.S_ISDIR(os.lstat(m).st_mode)
    masks = now
    root = Path(__file__).resolve().parents[2]
    needs = {sys.executable, os.path.realpath(sys.executable), os.path.realpath(os.__file__),
             str(root / "graders" / "machine" / "sandbox.py")}
    for m, is_dir in masks.items():
        for need in needs:
            if need == m or (is_dir and _under(need, [m])):
                raise SandboxUnavailable(
                    f"graded as root, the sandbox masks what other users cannot read, and {m} hides "
                    f"{need}, which learner code needs: make it readable (chmod -R o+rX {m}) or grade "
                    "as an ordinary user")
    return sorted(masks.items())


def _mask_trees() -> list[Path]:
    """The folders a sandbox started by root scans for masks: the system's (not its links) and those
    bound for the code (:func:`_needed_paths`)."""
    system = [Path(f) for f in SYSTEM_FOLDERS if Path(f).is_dir() and not Path(f).is_symlink()]
    return system + _needed_paths()


def share_masks(folder: Path) -> dict[str, str]:
    """Graded as root: scan the folders every sandbox binds now, write the masks to ``folder``
    (the grading run's own, which only root can write and which the run removes) and return the
    environment (:data:`MASKS_ENV`) that lets the processes started with it (nbgrader's kernel
    wrappers, one per notebook) read them instead of scanning again; {} when not root or the file
    cannot be written."""
    if os.geteuid() != 0:
        return {}
    scanned = _scanned([str(t) for t in _mask_trees()])
    path = Path(folder) / "sandbox-masks.json"
    try:
        with open(path, "x") as f:
            json.dump({"trees": {t: sorted(found.items()) for t, found in scanned.items()}}, f)
    except OSError:
        return {}
    return {MASKS_ENV: str(path)}


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

    Started by root, the sandbox also masks what other users could not read in the system's
    folders and those bound for the code (:func:`_root_masks`), not in ``readable``, ``writable``
    or ``scratch``, which show as they are.
    Raises:
        FileNotFoundError: bwrap is not installed.
        SandboxUnavailable: started by root, and the masks would hide what Python needs or are too many.
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
    scratch = [(Path(p), mb) for p, mb in scratch]
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
    masks = []
    if os.geteuid() == 0:  # after the back binds at equal depth: a root-only entry of a hidden checkout
        masks = _root_masks(_mask_trees(), hidden, [*back, *binds],
                            [*(Path(os.path.abspath(p)) for p in (*readable, *writable)), *(p for p, _ in scratch)])
    # a folder: an empty read-only tmpfs (remounted below); a file: /dev/null without device access
    mounts += [(Path(m), 2, ["--tmpfs", m] if is_dir else ["--ro-bind", "/dev/null", m]) for m, is_dir in masks]
    mounts += [(p, 2, ["--size", str(mb * 2**20), "--tmpfs", str(p)]) for p, mb in scratch]
    mounts += [(Path(p), 3, ["--ro-bind", str(p), str(p)]) for p in readable]
    mounts += [(Path(p), 4, ["--bind", str(p), str(p)]) for p in writable]
    for _, _, mount in sorted(mounts, key=lambda m: (len(m[0].parts), m[1])):
        args += mount
    for path in folders:  # after the binds: bwrap creates their mount points inside the empty folder
        if path != Path("/tmp"):
            args += ["--remount-ro", str(path)]
    for m, is_dir in masks:
        if is_dir:
            args += ["--remount-ro", m]
    args += ["--remount-ro", "/"]
    if gpu:
        for dev in sorted(glob.glob("/dev/nvidia*")):
            args += ["--dev-bind", dev, dev]
    # the /dev that --dev makes is a RAM tmpfs with no size bound that learner code could fill (as
    # root, with only the cgroup's memory limit, if any, above it); read-only once its device nodes and
    # mount points exist: writing a device node (/dev/null) needs no write access to the folder, and
    # /dev/shm and /dev/pts are mounts of their own that stay as they are
    args += ["--remount-ro", "/dev"]
    args += ["--clearenv"]
    for k, v in (env if env is not None else sandbox_env()).items():
        args += ["--setenv", k, str(v)]
    args += ["--chdir", str(cwd or "/tmp"), "--", *command]
    return _with_seccomp(args)


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
