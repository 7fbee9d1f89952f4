"""A pre-imported fork server for grader children: the fixed cost of a check drops from seconds
(a fresh Python importing torch, triton's interpreter and the reference) to a fork.

One server per grading process (the learner's kernel, ``graders.course``, a test worker), started on
first use (``graders.check`` in a notebook starts it when graders is imported). It imports what a
child needs once, never runs learner code itself and never initialises CUDA: a CUDA context does not
survive a fork, but a process that never created one may fork children that each create their own.
So there are two kinds of server. A "cpu" server runs the jobs graded on the CPU (on a GPU machine
with the GPU hidden from it). A "cuda" server (GPU machines) has the device nodes bound and the
driver untouched (``PYTORCH_NVML_BASED_CUDA_CHECK=1``: even ``torch.cuda.is_available()`` asks NVML,
not the driver); before it reports ready it forks one probe child that creates a CUDA context, and
if that fails the client falls back to a fresh process per check (:class:`CudaForkUnsafe`). A cuda
server's children share one Triton cache: the scope's folder (``graders.machine.core.triton_cache_scope``,
one per student in the trusted re-grade) or the server's own private one. Servers of either kind
are pooled by (kind, scope): a server started for one student's checks never runs another's.

No state passes between two checks through a server: it runs in isolated mode (``python -I``: no
working folder, /tmp or PYTHON* variable on its module search path) from a read-only working
folder, and in the sandbox it empties its /tmp (all but its own job folder), /dev/shm and the
System V IPC objects of its namespace after every job, once every process of the job is killed.
For each job it forks one child that runs ``graders.machine.runner`` on the job's folder under the time
budget, kills the child's process group when it ends (and, in the sandbox, every other process
left in the sandbox's PID namespace), and sends back the files the child wrote.

Jobs and results travel over the server's stdin/stdout as length-prefixed frames (:func:`pack`): the
server needs no folder of the host, so in the sandbox (``graders.machine.sandbox``) everything learner code
can write lies in the sandbox's private, size-bounded /tmp. Only the file names the comparer reads
come back, at most :data:`MAX_RESULT_BYTES` per graded answer. The comparer decodes them as data (JSON,
safetensors: ``graders.machine.wire``); nothing is unpickled.

When the process that started the server dies (a kernel restarted, shut down or killed), the
server sees end-of-file on its stdin and exits, killing its child; in the sandbox, bwrap's
``--die-with-parent`` takes the whole PID namespace with it. Interrupting a check (KeyboardInterrupt
in the waiting process) kills the server; the next check starts a new one.

Source: the fork-server pattern of Python's ``multiprocessing.forkserver`` and of Android's zygote.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from graders.machine.sandbox import set_parent_death_signal

__all__ = ["ForkServer", "CudaForkUnsafe", "server", "run_job", "usable", "kill_all", "prestart", "hide", "hidden_folders", "pack", "unpack", "MAX_RESULT_BYTES"]

MAX_RESULT_BYTES = 64 * 2**20
_HEADER = struct.Struct(">Q")
#: The files of a job folder the comparer reads (graders.machine.core._verdicts and grade_many_under_secrets).
_RESULT_NAME = re.compile(r"^(s\d+/)?(result_\d+\.json|result_\d+\.safetensors|load\.json|status\.json|stderr\.txt)$")
IN_SANDBOX_ENV = "LORA_BOOK_IN_SANDBOX"
KIND_ENV = "LORA_BOOK_FORKSERVER_KIND"
START_TIMEOUT_S = 120.0
SERVER_TMP_MB = 1024


# ---------------------------------------------------------------------------------------------
# Frames


def pack(meta: dict, files: dict[str, bytes]) -> bytes:
    """One frame: an 8-byte length, a JSON header line (``meta`` and the files' names and sizes),
    then the files' bytes."""
    header = json.dumps({"meta": meta, "files": [[k, len(v)] for k, v in files.items()]}).encode() + b"\n"
    body = header + b"".join(files.values())
    return _HEADER.pack(len(body)) + body


def unpack(body: bytes) -> tuple[dict, dict[str, bytes]]:
    """Inverse of :func:`pack` (without the length prefix).

    Raises:
        ValueError: a malformed frame.
    """
    end = body.index(b"\n")
    header = json.loads(body[:end])
    files, pos = {}, end + 1
    for name, size in header["files"]:
        if not isinstance(name, str) or not isinstance(size, int) or size < 0 or pos + size > len(body):
            raise ValueError("malformed frame")
        files[name] = body[pos:pos + size]
        pos += size
    return header["meta"], files


def _read_exact(fd: int, n: int, deadline: Optional[float] = None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("no answer from the grader's fork server in time")
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the grader's fork server closed its pipe")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, deadline: Optional[float] = None, limit: int = MAX_RESULT_BYTES + 2**20) -> bytes:
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    if n > limit:
        raise ValueError(f"frame of {n} bytes, over the limit of {limit}")
    return _read_exact(fd, n, deadline)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# ---------------------------------------------------------------------------------------------
# The server (python -m graders.machine.forkserver)


def _kill_the_rest() -> None:
    """In the sandbox's PID namespace: kill every process but its init (1) and this server."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in (1, me):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _collect(jobdir: Path, sources: int = 1) -> tuple[dict[str, bytes], Optional[str]]:
    """The result files of a job (:data:`MAX_RESULT_BYTES` per graded source), or an error."""
    files, total, cap = {}, 0, MAX_RESULT_BYTES * max(1, sources)
    for path in sorted(jobdir.rglob("*")):
        rel = path.relative_to(jobdir).as_posix()
        if not _RESULT_NAME.match(rel) or path.is_symlink() or not path.is_file():
            continue
        total += path.stat().st_size
        if total > cap:
            return {}, f"the results came to more than {cap >> 20} MiB (the grader's limit)"
        files[rel] = path.read_bytes()
    return files, None


def _run(jobdir: Path, timeout: float, stdin_fd: int, sandboxed: bool) -> dict:
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.setpgid(0, 0)
            set_parent_death_signal()
            from graders.machine.sandbox import limit_resources

            # CUDA maps far more address space than it uses: no RLIMIT_AS in a cuda server's child
            limit_resources(cpu_only=os.environ.get(KIND_ENV) != "cuda")
            null = os.open(os.devnull, os.O_RDWR)
            err = os.open(jobdir / "stderr.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(null, 0)
            os.dup2(null, 1)  # the frame pipe is fd 1 of the server: learner code never sees it
            os.dup2(err, 2)
            os.closerange(3, 1024)
            os.chdir(jobdir)
            from graders.machine import runner

            runner.main(jobdir)
            code = 0
        except BaseException:  # noqa: BLE001 (the status says how it ended; stderr has the rest)
            import traceback

            with contextlib.suppress(Exception):
                traceback.print_exc()
        finally:
            os._exit(code)
    from graders.machine.runner import wait_for_group

    # the parent never writes during a job: stdin readable means end-of-file (the parent died)
    code, timed_out, orphaned = wait_for_group(pid, timeout, lambda s: bool(select.select([stdin_fd], [], [], s)[0]))
    if sandboxed:
        _kill_the_rest()  # also what left its group (setsid, double fork)
    if orphaned:
        os._exit(0)
    return {"code": code, "timed_out": timed_out}


def _cuda_probe() -> Optional[str]:
    """In a cuda server, before the first job: fork a child that creates a CUDA context and runs
    one kernel. None when it worked, else what went wrong (the driver was initialised in this
    process by an import, or the device is unusable)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            set_parent_death_signal()
            import torch

            code = 0 if float(torch.ones(4, device="cuda").sum()) == 4.0 else 1
        except BaseException:  # noqa: BLE001 (the exit code is the answer)
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return "a CUDA context cannot be created in a child forked from the server"
    import torch

    if torch.cuda.is_initialized():
        return "an import initialised CUDA in the server"
    return None


def _mount_points() -> list[Path]:
    points = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            points.append(Path(line.split()[4].replace("\\040", " ")))
    return points


def _wipe(folder: Path, keep: Path, mounts: list[Path]) -> None:
    """Delete everything under ``folder`` but ``keep`` and what is mounted there (a Triton cache or
    a checkout bound in): what a job's processes left for the next job to find."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        path = Path(entry.path)
        if path == keep or path in mounts:
            continue
        if any(m.is_relative_to(path) for m in mounts) and entry.is_dir(follow_symlinks=False):
            _wipe(path, keep, mounts)
        elif entry.is_dir(follow_symlinks=False):
            _force(entry.path)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _force(path: str) -> None:
    """Remove a folder a job may have made unreadable or unwritable."""
    def fix(fn, failed, exc):
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(failed), 0o700)
            if os.path.isdir(failed) and not os.path.islink(failed):
                os.chmod(failed, 0o700)
                shutil.rmtree(failed, ignore_errors=True)
            else:
                os.unlink(failed)
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    shutil.rmtree(path, onerror=fix)


def _remove_sysv_ipc() -> None:
    """Remove the System V shared memory, semaphores and message queues of this IPC namespace (the
    sandbox's own, shared by every job of this server)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    ipc_rmid = 0
    for table, remove in (("shm", lambda i: libc.shmctl(i, ipc_rmid, None)),
                          ("sem", lambda i: libc.semctl(i, 0, ipc_rmid)),
                          ("msg", lambda i: libc.msgctl(i, ipc_rmid, None))):
        with contextlib.suppress(OSError, ValueError, IndexError, AttributeError):
            for line in Path(f"/proc/sysvipc/{table}").read_text().splitlines()[1:]:
                remove(int(line.split()[1]))


def _clean_between_jobs(base: Path) -> None:
    """In the sandbox, after a job's processes are gone: its /tmp (but the server's own folder),
    /dev/shm and System V IPC objects are emptied, so no file, module or segment one check leaves
    is there for the next (another exercise, or, in a server reused across them, another student)."""
    mounts = _mount_points()
    for folder in (Path("/tmp"), Path("/dev/shm")):
        _wipe(folder, base, mounts)
    _remove_sysv_ipc()


def serve() -> None:
    """The server's loop: read a job frame, fork a child for it, answer with the results frame."""
    set_parent_death_signal()
    os.chdir("/")  # read-only in the sandbox; never on the module search path (python -I)
    in_fd, out_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    cuda = os.environ.get(KIND_ENV) == "cuda"
    base = Path(tempfile.mkdtemp(prefix="lora-book-jobs-"))
    if cuda and not os.environ.get("TRITON_CACHE_DIR"):
        # no scope given: a cache of this server's own, shared by its children only
        os.environ["TRITON_CACHE_DIR"] = str(base / "triton-cache")
    # imported once here, inherited by every child
    # (by name: the learner API, ``graders``, sits above this machine; an answer imports it)
    for module in ("torch", "reference", "graders", "graders.machine.runner"):
        importlib.import_module(module)
    from graders.machine import registry

    registry.load_all()  # every chapter's case library and its references
    with contextlib.suppress(ImportError):
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    sandboxed = os.environ.get(IN_SANDBOX_ENV) == "1"
    problem = _cuda_probe() if cuda else None
    _write_all(out_fd, pack({"ready": problem is None, "sandboxed": sandboxed, "problem": problem}, {}))
    if problem is not None:
        shutil.rmtree(base, ignore_errors=True)
        return
    n = 0
    while True:
        try:
            meta, files = unpack(_read_frame(in_fd, limit=2**31))
        except (EOFError, OSError):
            break
        jobdir = base / f"job{n}"
        n += 1
        jobdir.mkdir()
        for name in ("job.json", "inputs.safetensors"):
            (jobdir / name).write_bytes(files.get(name, b""))
        status = _run(jobdir, float(meta["timeout"]), in_fd, sandboxed)
        results, error = _collect(jobdir, int(meta.get("sources", 1)))
        shutil.rmtree(jobdir, ignore_errors=True)
        if sandboxed:
            _clean_between_jobs(base)
        _write_all(out_fd, pack({**status, "error": error}, results))
    shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The client


#: ``LORA_BOOK_FORKSERVER=off``: every check spawns a fresh process (for comparison, or debugging);
#: ``=cpu``: only the checks graded on the CPU go through a server.
SWITCH_ENV = "LORA_BOOK_FORKSERVER"

#: Set when a cuda server's probe failed in this process: its CUDA checks spawn from then on.
_CUDA_UNSAFE: list[str] = []


class CudaForkUnsafe(RuntimeError):
    """A cuda fork server cannot run CUDA jobs here (its probe child could not create a context)."""


def usable(device: str = "cpu") -> bool:
    """Whether a job graded on ``device`` ("cpu", "cuda", "cuda:0") goes through a fork server.

    CPU jobs: unless ``LORA_BOOK_FORKSERVER=off``. CUDA jobs: unless that is ``off`` or ``cpu``, or a
    cuda server's probe already failed in this process.
    """
    switch = os.environ.get(SWITCH_ENV, "on")
    if switch == "off" or not hasattr(os, "fork"):
        return False
    return not str(device).startswith("cuda") or (switch != "cpu" and not _CUDA_UNSAFE)


def _gpu_machine() -> bool:
    import torch

    return torch.cuda.is_available()


_SPAWNS = None  # a queue.Queue of spawn requests, once the spawner thread runs
_SPAWNER_LOCK = threading.Lock()


def _spawn(argv: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` from one long-lived thread of this process.

    Why: Linux delivers a parent-death signal (``PR_SET_PDEATHSIG``, used by the server and by
    bwrap's ``--die-with-parent``) when the *thread* that created the child exits, so a server
    started from a short-lived worker thread (a ThreadPoolExecutor's) would be killed with it.
    """
    global _SPAWNS
    import queue
    from concurrent.futures import Future

    with _SPAWNER_LOCK:
        if _SPAWNS is None:
            _SPAWNS = queue.Queue()

            def loop():
                while True:
                    future, args, kwargs = _SPAWNS.get()
                    try:
                        future.set_result(subprocess.Popen(args, **kwargs))
                    except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                        future.set_exception(exc)
            threading.Thread(target=loop, name="graders-forkserver-spawner", daemon=True).start()
    future: Future = Future()
    _SPAWNS.put((future, argv, popen_kwargs))
    return future.result()


class ForkServer:
    """A handle on one fork server process (started by :meth:`start`)."""

    def __init__(self, kind: str = "cpu", cache: Optional[Path] = None):
        """``kind``: "cpu" or "cuda" (see the module's docstring); ``cache``: the scope's folder (one
        per student in the trusted re-grade; None outside any scope): the pool never hands this
        server to another scope's check, and a cuda server uses it as its Triton cache (bound
        writable in the sandbox; None: one of its own)."""
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"kind must be 'cpu' or 'cuda', not {kind!r}")
        self.kind, self.scope = kind, (Path(cache) if cache is not None else None)
        self.cache = self.scope if kind == "cuda" else None
        self.proc: Optional[subprocess.Popen] = None
        self.sandboxed = False
        self.lock = threading.Lock()  # one job at a time per server

    def start(self) -> None:
        """Start the server and wait until it has imported everything.

        Raises:
            graders.machine.sandbox.SandboxUnavailable: the sandbox is required and cannot run.
            CudaForkUnsafe: a cuda server whose probe failed (recorded: this process's CUDA checks
                spawn from now on).
            RuntimeError: the server did not start.
        """
        from graders.machine import sandbox

        command = sandbox.python_argv("graders.machine.forkserver")
        extra = {KIND_ENV: self.kind}
        if self.kind == "cuda":
            extra["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # is_available() must not initialise the driver
            if self.cache is not None:
                self.cache.mkdir(parents=True, exist_ok=True, mode=0o700)
                extra["TRITON_CACHE_DIR"] = str(self.cache)
        elif _gpu_machine():
            extra["CUDA_VISIBLE_DEVICES"] = ""  # a cpu server and its children never see the GPU
        if sandbox.enabled():
            # /tmp holds each job's inputs and results: a mutation batch of 20 kernel answers
            # writes about 110 MiB (tmpfs pages are used only as written)
            argv = sandbox.bwrap_argv(command, hidden=hidden_folders(), tmp_mb=SERVER_TMP_MB,
                                      writable=[self.cache] if self.cache is not None else [],
                                      gpu=self.kind == "cuda",
                                      env=sandbox.sandbox_env({IN_SANDBOX_ENV: "1", **extra}))
            env = None
            from graders.machine import cgroups

            preexec = cgroups.enter  # the server and every job it forks: one sandbox's bounds
        else:
            preexec = None
            argv, env = command, sandbox.sandbox_env({"HOME": os.environ.get("HOME", "/tmp"),
                                                      "TMPDIR": tempfile.gettempdir(), **extra})
        self.proc = _spawn(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           start_new_session=True, env=env, cwd=tempfile.gettempdir(), preexec_fn=preexec)
        try:
            meta, _ = unpack(_read_frame(self.proc.stdout.fileno(), time.monotonic() + START_TIMEOUT_S))
        except (EOFError, TimeoutError, ValueError) as exc:
            self.kill()
            raise RuntimeError(f"the grader's fork server did not start: {exc}") from exc
        self.sandboxed = bool(meta.get("sandboxed"))
        if not meta.get("ready"):
            self.kill()
            _CUDA_UNSAFE.append(str(meta.get("problem")))
            raise CudaForkUnsafe(f"the grader's cuda fork server cannot run CUDA jobs: {meta.get('problem')}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def run(self, workdir: Path, timeout: float) -> tuple[Optional[int], bool, str]:
        """Run the job in ``workdir`` (job.json, inputs.safetensors) in a forked child; write the
        child's result files into ``workdir``. Returns (exit code or None, timed out, stderr tail).

        Raises:
            RuntimeError: the server died or stopped answering (it is killed; the next job starts
                a new one).
        """
        with self.lock:
            if not self.alive():
                self.start()
            files = {name: (workdir / name).read_bytes() for name in ("job.json", "inputs.safetensors")}
            sources = len(json.loads(files["job.json"]).get("sources", [None]))
            try:
                _write_all(self.proc.stdin.fileno(), pack({"timeout": timeout, "sources": sources}, files))
                meta, results = unpack(_read_frame(self.proc.stdout.fileno(), time.monotonic() + timeout + 60,
                                                   limit=MAX_RESULT_BYTES * max(1, sources) + 2**20))
            except BaseException as exc:  # KeyboardInterrupt too: no child may outlive the wait
                self.kill()
                if isinstance(exc, (EOFError, TimeoutError, ValueError, OSError)):
                    raise RuntimeError(f"the grader's fork server failed: {exc}") from exc
                raise
        for rel, data in results.items():
            if _RESULT_NAME.match(rel):
                (workdir / rel).parent.mkdir(parents=True, exist_ok=True)
                (workdir / rel).write_bytes(data)
        stderr = results.get("stderr.txt", b"").decode(errors="replace")[-800:]
        if meta.get("error"):
            stderr = meta["error"] + "\n" + stderr
        return meta.get("code"), bool(meta.get("timed_out")), stderr

    def kill(self) -> None:
        """Kill the server and everything it started (its process group; bwrap's namespace)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(Exception):
                f.close()
        self.proc = None


_HIDDEN: list[Path] = []  # the course roots given to hide()
_HIDDEN_DATA: list[Path] = []  # what a sandbox hides of them (sandbox.course_hidden), computed once


def hide(folder: Path) -> None:
    """Hide ``folder`` (a course being graded: the grading command's own argument) and its data
    (``sandbox.course_data``: gradebook, submissions, feedback, ...) from every grader child started
    from now on, even where the course folder is, holds or lies in the checkout; the fork servers
    already running are stopped so their successors start without it."""
    from graders.machine import sandbox

    folder = Path(folder).resolve()
    if folder not in _HIDDEN:
        _HIDDEN.append(folder)
        _HIDDEN_DATA[:] = sandbox.course_hidden(_HIDDEN)
        kill_all()


def hidden_folders() -> list[Path]:
    """Paths a grader child has no business reading: the courses given to :func:`hide` with their
    data (hidden even inside the checkout: ``sandbox.bwrap_argv`` mounts them over it), and the
    current folder (a learner's notebook folder, or a course's root) unless it holds the book's own
    sources."""
    root = Path(__file__).resolve().parents[2]
    here = Path.cwd().resolve()
    folders = [*_HIDDEN_DATA, *([here] if not root.is_relative_to(here) else [])]
    return [f for f in dict.fromkeys(folders) if f != Path("/")]


_POOL_LOCK = threading.Lock()
_IDLE: list[ForkServer] = []  # oldest first
_ALL: list[ForkServer] = []


def _max_idle() -> int:
    return max(2, os.cpu_count() or 1)


def server(kind: str = "cpu", cache: Optional[Path] = None) -> ForkServer:
    """An idle fork server of this process of this ``kind`` and scope ``cache`` (a student's folder,
    see :class:`ForkServer`), or a new one (started on its first job). Threads that grade in
    parallel (``graders.course``) each hold their own while a job runs (:func:`run_job`); servers
    outlive the threads and are killed at exit."""
    want = (kind, Path(cache) if cache is not None else None)
    with _POOL_LOCK:
        for srv in reversed(_IDLE):
            if (srv.kind, srv.scope) == want:
                _IDLE.remove(srv)
                return srv
        srv = ForkServer(*want)
        _ALL.append(srv)
        return srv


def _release(srv: ForkServer) -> None:
    with _POOL_LOCK:
        if srv not in _IDLE:
            _IDLE.append(srv)
        # each server holds torch imported (hundreds of MB): servers of caches no longer in use
        # (students already graded) go first
        surplus = _IDLE[:max(0, len(_IDLE) - _max_idle())]
        for old in surplus:
            _IDLE.remove(old)
            _ALL.remove(old)
    for old in surplus:
        old.kill()


def kill_all() -> None:
    """Kill every fork server this process started."""
    with _POOL_LOCK:
        servers = list(_ALL)
    for srv in servers:
        srv.kill()


atexit.register(kill_all)


def run_job(workdir: Path, timeout: float, kind: str = "cpu",
            cache: Optional[Path] = None) -> tuple[Optional[int], bool, str]:
    """:meth:`ForkServer.run` on an idle server of this process (:func:`server`).

    Raises:
        CudaForkUnsafe: see :meth:`ForkServer.start` (the caller spawns the job instead).
    """
    srv = server(kind, cache)
    try:
        return srv.run(workdir, timeout)
    finally:
        _release(srv)


def prestart(kind: Optional[str] = None) -> None:
    """Start a server in the background (a notebook's first check is then fast): by default the
    kind this machine's checks use ("cuda" on a GPU machine)."""
    kind = kind or ("cuda" if _gpu_machine() and usable("cuda") else "cpu")
    srv = server(kind)
    _release(srv)  # idle at once: a check that takes it waits on its lock until the start is done

    def go():
        with contextlib.suppress(Exception), srv.lock:
            if not srv.alive():
                srv.start()
    threading.Thread(target=go, daemon=True).start()


if __name__ == "__main__":
    serve()
