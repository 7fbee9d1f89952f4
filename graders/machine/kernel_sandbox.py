"""The sandboxed Jupyter kernel nbgrader's autograde runs submissions in.

``python -m graders.machine.kernel_sandbox -f CONNECTION_FILE`` is the argv of the kernelspec
``lora-book-sandboxed`` (:func:`install_kernelspec`): it replaces itself (exec) with bubblewrap
running ``ipykernel`` (``graders.machine.sandbox.bwrap_argv``), so the kernel and every process learner code
starts live in the sandbox and die with nbgrader:

- the course folder and its data (gradebook.db, every other submission, the instructor's source
  notebooks: ``sandbox.course_hidden``) are hidden, even where the course folder is, holds or lies
  in the checkout every sandbox sees; which course is the grading command's word
  (``sandbox.COURSE_ENV``, set by ``graders.course.autograde``), else the nbgrader course found above
  the notebook's folder, never in it (a student's submission fills that folder, markers included);
- the notebook's own folder (nbgrader's working folder for it) shows its regular files and folders
  read-only (never a link, a fifo or a device: bwrap would follow a link on the host) in a writable
  tmpfs of :data:`NOTEBOOK_MB`: what the kernel writes there stays in memory, bounded, and never
  reaches the course folder or the feedback;
- the grading run's work folder and runtime folder (every kernel's connection file with its key,
  every kernel's sockets) are hidden, wherever TMPDIR puts them, but for this kernel's own
  connection file (read-only) and ipc folder;
- no network: the kernel talks to nbgrader over ZMQ's ``ipc`` transport (Unix sockets in the
  folder of the connection's ``ip`` prefix, which both sides see). That folder must hold nothing
  but this run's sockets (another kernel's there would let learner code talk to it), so the course
  command makes one per autograde run (:func:`ipc_folder`, marked with :data:`IPC_MARKER`) and this
  wrapper refuses any other;
- no instructor secret in its environment: the notebook's test cells grade the hidden group from
  the public seed, and the trusted re-grade (``graders.course verify``), whose cases are built
  outside every sandbox, is the score that is recorded;
- interrupts arrive as messages (``interrupt_mode: message``), since a signal to bwrap would not
  reach the kernel inside.

Source: nbgrader runs notebooks through nbclient, which starts the kernel from a kernelspec; the
kernelspec's argv is the documented hook for wrapping a kernel (jupyter_client "Kernel specs").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from graders.machine import sandbox

KERNEL_NAME = "lora-book-sandboxed"
#: The notebook folder's size in the kernel, MiB: a tmpfs over it (the files there show read-only).
NOTEBOOK_MB = 128
#: The file that marks a folder made for one grading run's kernel sockets (:func:`ipc_folder`).
IPC_MARKER = ".lora-book-ipc"
__all__ = ["KERNEL_NAME", "IPC_MARKER", "install_kernelspec", "ipc_folder", "course_root", "kernel_argv", "main"]


def ipc_folder(parent: Path) -> Path:
    """A new folder under ``parent`` for one grading run's kernel sockets (ZMQ ipc), marked so the
    wrapper accepts it; pass ``<folder>/kernel`` as ``KernelManager.ip`` with transport ``ipc``."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="ipc-", dir=parent))
    (folder / IPC_MARKER).write_text("sockets of one grading run's kernels\n")
    return folder


def install_kernelspec(jupyter_dir: Path) -> Path:
    """Write the kernelspec into ``jupyter_dir/kernels/lora-book-sandboxed/`` (put ``jupyter_dir``
    on ``JUPYTER_PATH``) and return its folder."""
    folder = jupyter_dir / "kernels" / KERNEL_NAME
    folder.mkdir(parents=True, exist_ok=True)
    spec = {"argv": [*sandbox.python_argv("graders.machine.kernel_sandbox"), "-f", "{connection_file}"],
            "display_name": "Python 3 (LoRA book, sandboxed)", "language": "python",
            "interrupt_mode": "message", "metadata": {"debugger": False}}
    (folder / "kernel.json").write_text(json.dumps(spec, indent=1))
    return folder


def course_root(start: Path) -> Path | None:
    """The nbgrader course folder at or above ``start`` (the first holding nbgrader_config.py or
    gradebook.db), or None. Pass a folder no student fills (the kernel starts at its notebook
    folder's parent)."""
    for folder in [start, *start.parents]:
        if (folder / "nbgrader_config.py").exists() or (folder / "gradebook.db").exists():
            return folder
    return None


def _ipc_folder(conn: dict, connection_file: Path) -> Path:
    ip = Path(conn["ip"])
    return (ip if ip.is_absolute() else Path.cwd() / ip).parent


def _shown(folder: Path) -> list[Path]:
    """The entries of the notebook's folder the kernel sees: regular files and folders, never a link
    (bwrap resolves a bind's source on the host: a link would show whatever it names), a fifo, a
    socket or a device."""
    import stat

    shown = []
    for entry in sorted(folder.iterdir()):
        mode = entry.lstat().st_mode
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            shown.append(entry)
    return shown


def kernel_argv(command: list[str], connection_file: Path, cwd: Path, conn: dict) -> tuple[list[str], bool]:
    """The bwrap argv that runs ``command`` (ipykernel) for the notebook in ``cwd``, and whether it
    uses the GPU.

    Raises:
        SystemExit: the connection's ipc folder was not made for it (:func:`ipc_folder`).
    """
    writable = []
    share_net = conn.get("transport") != "ipc"
    if not share_net:
        ipc = _ipc_folder(conn, connection_file).resolve()
        if not (ipc / IPC_MARKER).exists():
            sys.exit(f"graders.machine.kernel_sandbox: the kernel's ipc folder {ipc} was not made for it (no "
                     f"{IPC_MARKER}): other kernels' sockets there would be open to learner code; "
                     f"use graders.course.jobs.ipc_config() (python -m graders.course grade does)")
        writable.append(ipc)
    # the notebook's folder: what is there now, read-only, in a tmpfs of NOTEBOOK_MB that takes the
    # kernel's writes (nothing it writes reaches the host's disk, nor the feedback)
    readable = [connection_file, *_shown(cwd)]
    # the course: the grading command's word; else found above the notebook's folder (the
    # submission fills that folder: a marker planted there must not decide what is hidden)
    courses = sandbox.trusted_courses()
    if not courses:
        found = course_root(cwd.parent)
        courses = [found] if found is not None else []
    hidden = sandbox.course_hidden(courses)
    # the grading run's work folder (every kernel's connection file, with its key, and sockets) and
    # the runtime folder, wherever they are: only this kernel's own file and ipc folder show
    hidden += [connection_file.parent] + [w.parent for w in writable]
    cuda = any(Path("/dev").glob("nvidia[0-9]*"))
    return sandbox.bwrap_argv(command, writable=writable, readable=readable, hidden=hidden, cwd=cwd,
                              gpu=cuda, share_net=share_net, scratch=[(cwd, NOTEBOOK_MB)]), cuda


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m graders.machine.kernel_sandbox")
    parser.add_argument("-f", dest="connection_file", required=True, type=Path)
    args = parser.parse_args(argv)
    connection_file = args.connection_file.resolve()
    command = [sys.executable, "-m", "ipykernel_launcher", "-f", str(connection_file)]
    if not sandbox.enabled():  # auto mode without bwrap: plain ipykernel (self-study, macOS)
        os.execv(command[0], command)
    conn = json.loads(connection_file.read_text())
    argv, cuda = kernel_argv(command, connection_file, Path.cwd().resolve(), conn)
    sandbox.limit_resources(cpu_only=not cuda)  # inherited through exec
    from graders.machine import cgroups

    cgroups.enter()  # this kernel's processes and memory, bounded as a whole where the host allows
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main()
