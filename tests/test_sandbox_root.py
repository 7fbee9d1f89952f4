"""The sandbox started by root (issue #31): uid 0 inside holds no capability, changes no mount, writes
no host-wide /proc entry, and reads only what any user could read in the folders it sees
(graders.machine.sandbox._root_masks).
The tests that run learner code need root and bubblewrap; the scan's own tests run anywhere."""
from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from graders.machine import sandbox

needs_root_bwrap = pytest.mark.skipif(
    os.geteuid() != 0 or not sandbox.available(),
    reason="needs root (the masks and the dropped capabilities apply only to a sandbox root starts) and bwrap")

#: Run in the sandbox: reads each path given, lists each folder, prints what it saw.
_READ = textwrap.dedent('''
    import json, os, sys
    seen = {}
    for path in sys.argv[1:]:
        try:
            seen[path] = sorted(os.listdir(path)) if os.path.isdir(path) else open(path).read()
        except OSError as e:
            seen[path] = type(e).__name__
    print("SEEN " + json.dumps(seen) + " END")
''')


def _stand_in_checkout(tmp_path: Path, monkeypatch) -> Path:
    """A folder every sandbox binds for the code (as the checkout is), holding root-only files."""
    book = tmp_path / "book"
    (book / "graders").mkdir(parents=True)
    (book / "graders" / "code.py").write_text("CODE\n")
    for name, mode in (("secret.txt", 0o600), ("group_only.txt", 0o640), ("write_only.txt", 0o200)):
        (book / name).write_text(f"ROOT ONLY {name}\n")
        (book / name).chmod(mode)
    private = book / "private"
    private.mkdir()
    (private / "inner.txt").write_text("INSIDE A 0700 FOLDER\n")
    private.chmod(0o700)
    keys = book / "keys"  # many root-only files in one folder: one mask for the folder
    keys.mkdir()
    for i in range(MASKS_IN_A_FOLDER):
        (keys / f"k{i}").write_text("KEY\n")
        (keys / f"k{i}").chmod(0o600)
    needed = sandbox._needed_paths
    monkeypatch.setattr(sandbox, "_needed_paths", lambda: [*needed(), book])
    return book


MASKS_IN_A_FOLDER = sandbox.MASKS_PER_FOLDER + 4


def _run(argv: list[str]) -> dict:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    found = re.search(r"SEEN (.*) END", proc.stdout)
    assert found, (proc.returncode, proc.stdout[-1000:], proc.stderr[-2000:])
    return json.loads(found.group(1))


@needs_root_bwrap
def test_root_in_the_sandbox_reads_only_what_any_user_could(tmp_path, monkeypatch):
    """A 0600 / 0640 file of a bound folder, a 0700 folder's file, /etc/shadow: not readable by the
    sandbox's uid 0 (opening the mask fails, as it would for another user); the code and
    /etc/passwd still read; a folder of many root-only files is masked whole."""
    book = _stand_in_checkout(tmp_path, monkeypatch)
    paths = [book / "graders" / "code.py", book / "secret.txt", book / "group_only.txt", book / "private" / "inner.txt",
             book / "private", book / "keys", book / "keys" / "k0", Path("/etc/passwd")]
    shadow = Path("/etc/shadow")
    if shadow.exists() and not shadow.stat().st_mode & stat.S_IROTH:
        paths.append(shadow)
    argv = sandbox.bwrap_argv([sys.executable, "-I", "-c", _READ, *map(str, paths)])
    seen = _run(argv)
    assert seen.pop(str(book / "graders" / "code.py")) == "CODE\n"
    assert "root:" in seen.pop("/etc/passwd")
    assert seen.pop(str(book / "private")) == []  # an empty read-only folder in its place
    assert seen.pop(str(book / "keys")) == []
    assert set(seen.values()) <= {"PermissionError", "FileNotFoundError"}, seen
    assert seen[str(book / "secret.txt")] == "PermissionError"  # the file is there; it cannot be read
    masks = dict(sandbox._scanned([str(book)])[str(book)])
    assert masks == {str(book / "secret.txt"): False, str(book / "group_only.txt"): False,
                     str(book / "private"): True, str(book / "keys"): True}  # not the write-only file
    assert (book / "secret.txt").read_text() == "ROOT ONLY secret.txt\n"  # the host's file is untouched


@needs_root_bwrap
def test_what_the_caller_binds_shows_and_hidden_course_data_stays_hidden(tmp_path, monkeypatch):
    """A root-only file bound ``readable`` (a kernel's 0600 connection file) or in a ``writable``
    folder reads as it is; a root-only file inside a hidden course folder in the checkout gets no
    mask (its mount point would name it): the hidden folder stays empty."""
    book = _stand_in_checkout(tmp_path, monkeypatch)
    course = book / "course"
    (course / "submitted" / "alice").mkdir(parents=True)
    (course / "submitted" / "alice" / "answer.txt").write_text("ALICE\n")
    (course / "submitted" / "alice" / "answer.txt").chmod(0o600)
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    (work / "own.txt").write_text("MINE\n")
    (work / "own.txt").chmod(0o600)
    conn = book / "secret.txt"  # shown on purpose, as a kernel's connection file is
    argv = sandbox.bwrap_argv([sys.executable, "-I", "-c", _READ, str(conn), str(work / "own.txt"), str(course),
                               str(course / "submitted" / "alice" / "answer.txt")],
                              readable=[conn], writable=[work], hidden=[course])
    seen = _run(argv)
    assert seen == {str(conn): "ROOT ONLY secret.txt\n", str(work / "own.txt"): "MINE\n", str(course): [],
                    str(course / "submitted" / "alice" / "answer.txt"): "FileNotFoundError"}, seen


_ESCAPE = textwrap.dedent('''
    import ctypes, errno, json, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    hidden, secret = sys.argv[1], sys.argv[2]
    seen = {"uid": os.getuid()}
    for line in open("/proc/self/status"):
        if line.startswith("CapEff:"):
            seen["CapEff"] = int(line.split()[1], 16)
    def call(name, *args):
        r = getattr(libc, name)(*args)
        return "ok" if r == 0 else errno.errorcode[ctypes.get_errno()]
    seen["umount hidden"] = call("umount2", hidden.encode(), 2)  # MNT_DETACH
    seen["umount mask"] = call("umount2", secret.encode(), 2)
    seen["remount /usr rw"] = call("mount", None, b"/usr", None, 0x20 | 0x1000, None)  # MS_REMOUNT|MS_BIND
    seen["mount tmpfs"] = call("mount", b"none", b"/tmp", b"tmpfs", 0, None)
    seen["new user namespace"] = call("unshare", 0x10000000)  # CLONE_NEWUSER
    try:
        open("/usr/lora-book-probe", "w").close()
        seen["write /usr"] = "ok"
    except OSError as e:
        seen["write /usr"] = errno.errorcode[e.errno]
    seen["hidden listing"] = sorted(os.listdir(hidden))
    try:
        seen["secret"] = open(secret).read()
    except OSError as e:
        seen["secret"] = errno.errorcode[e.errno]
    print("SEEN " + json.dumps(seen) + " END")
''')


@needs_root_bwrap
def test_root_in_the_sandbox_holds_no_capability_and_changes_no_mount(tmp_path, monkeypatch):
    """bwrap started by root keeps every capability unless told otherwise: with CAP_SYS_ADMIN the
    sandbox unmounted the tmpfs hiding a course (another student's files showed) and remounted the
    host's /usr writable. Now: no capability, every mount change refused, no nested user namespace
    where bwrap supports ``--disable-userns``."""
    book = _stand_in_checkout(tmp_path, monkeypatch)
    course = book / "course"
    (course / "submitted" / "alice").mkdir(parents=True)
    (course / "submitted" / "alice" / "answer.txt").write_text("ALICE\n")
    argv = sandbox.bwrap_argv([sys.executable, "-I", "-c", _ESCAPE, str(course), str(book / "secret.txt")],
                              hidden=[course])
    probe = Path("/usr/lora-book-probe")
    try:
        seen = _run(argv)
    finally:
        written = probe.exists()
        probe.unlink(missing_ok=True)  # what a sandbox holding CAP_SYS_ADMIN wrote on the host
    assert not written
    assert seen["uid"] == 0 and seen["CapEff"] == 0, seen
    assert seen["umount hidden"] == seen["umount mask"] == "EPERM", seen
    assert seen["remount /usr rw"] == seen["mount tmpfs"] == "EPERM", seen
    assert seen["write /usr"] == "EROFS", seen
    assert seen["hidden listing"] == [] and seen["secret"] == "EACCES", seen
    if "--disable-userns" in sandbox._root_args():
        assert seen["new user namespace"] in ("ENOSPC", "EPERM", "EUSERS"), seen


_PROC_WRITES = textwrap.dedent('''
    import errno, json, os
    writable = []
    for folder, subfolders, files in os.walk("/proc"):
        if folder == "/proc":
            subfolders[:] = [d for d in subfolders if not d.isdigit() and d not in ("self", "thread-self")]
        for name in files:
            path = os.path.join(folder, name)
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # opened, nothing written
                writable.append(path)
            except OSError:
                pass
    sysctl = "/proc/sys/fs/lease-break-time"
    try:
        value = open(sysctl).read()
        with open(sysctl, "w") as f:
            f.write(value)  # the value it has: harmless where the write goes through
        outcome = "written"
    except OSError as e:
        outcome = errno.errorcode[e.errno]
    print("SEEN " + json.dumps({"writable": writable, "sysctl": outcome}) + " END")
''')


@needs_root_bwrap
def test_root_in_the_sandbox_writes_no_host_wide_proc_entry():
    """The sysctls belong to kernel uid 0 and check no capability: a sandbox started by root wrote
    them (``kernel.core_pattern`` names a program the host's kernel runs as root on a crash), as
    bwrap leaves /proc/sys writable there. Only the sandbox's own processes' entries and
    /proc/pressure (writable by anyone) open for writing now."""
    seen = _run(sandbox.bwrap_argv([sys.executable, "-I", "-c", _PROC_WRITES]))
    assert seen["sysctl"] == "EROFS", seen
    assert all(p.startswith("/proc/pressure/") for p in seen["writable"]), seen["writable"][:20]


# ---------------------------------------------------------------------------------------------
# the scan on its own (any user)


def _modes_tree(root: Path) -> Path:
    tree = root / "tree"
    (tree / "open" / "deep").mkdir(parents=True)
    files = {"open/a": 0o644, "open/deep/b": 0o600, "c": 0o640, "d": 0o200, "e": 0o000, "f": 0o604, "g": 0o755}
    for rel, mode in files.items():
        (tree / rel).write_text(rel)
        (tree / rel).chmod(mode)
    (tree / "closed").mkdir()
    (tree / "closed" / "x").write_text("x")
    (tree / "closed").chmod(0o750)
    (tree / "listless").mkdir()  # others may enter, not list: not masked, its files are judged alone
    (tree / "listless" / "y").write_text("y")
    (tree / "listless" / "y").chmod(0o600)
    (tree / "listless").chmod(0o711)
    (tree / "link").symlink_to(tree / "open" / "deep" / "b")  # a link is never masked: what it names is
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tree / "s"))
    sock.close()
    (tree / "s").chmod(0o660)
    os.mkfifo(tree / "p")
    (tree / "p").chmod(0o666)  # anyone may write it: not masked
    return tree


def test_the_scan_finds_what_other_users_cannot_read_with_find_or_without(tmp_path):
    tree = _modes_tree(tmp_path)
    expected = {str(tree / "open" / "deep" / "b"): False, str(tree / "c"): False, str(tree / "closed"): True,
                str(tree / "listless" / "y"): False, str(tree / "s"): False}
    assert sandbox._unreadable_walk(str(tree)) == expected
    sandbox._SCANNED.pop(str(tree), None)
    assert sandbox._scanned([str(tree)]) == {str(tree): expected}  # through find


def test_a_folder_of_many_masks_is_masked_whole_and_a_mostly_readable_one_is_not(tmp_path):
    tree = tmp_path / "t"
    for folder, masked, readable in (("keys", 20, 2), ("lib", 20, 200), ("pair", 2, 0), ("one", 1, 0)):
        (tree / folder).mkdir(parents=True)
        for i in range(masked + readable):
            (tree / folder / f"f{i}").write_text("")
    found = {str(tree / folder / f"f{i}"): False for folder, n in (("keys", 20), ("lib", 20), ("pair", 2), ("one", 1))
             for i in range(n)}
    collapsed = sandbox._collapse(str(tree), found)
    assert {m for m in collapsed if not m.startswith(str(tree / "lib"))} == {
        str(tree / "keys"), str(tree / "pair"), str(tree / "one" / "f0")}
    assert sum(m.startswith(str(tree / "lib") + "/") for m in collapsed) == 20  # 20 of 220: one each
    assert str(tree) not in sandbox._collapse(str(tree), {str(tree / "keys"): True, str(tree / "pair"): True})


def test_a_mask_that_would_hide_what_python_needs_refuses_to_sandbox(monkeypatch):
    graders_dir = str(Path(sandbox.__file__).resolve().parent)
    monkeypatch.setattr(sandbox, "_scanned", lambda trees: {t: {graders_dir: True} for t in trees})
    with pytest.raises(sandbox.SandboxUnavailable, match="chmod -R o\\+rX"):
        sandbox._root_masks([Path("/")], [], [], [])


def test_the_shared_scan_is_read_only_from_a_file_only_this_user_can_write(tmp_path, monkeypatch):
    folder = tmp_path / "masks"
    folder.mkdir(mode=0o700)
    path = folder / "masks.json"
    path.write_text(json.dumps({"trees": {"/x": [["/x/secret", False], ["/x/keys", True]]}}))
    path.chmod(0o600)
    monkeypatch.setenv(sandbox.MASKS_ENV, str(path))
    assert sandbox._read_shared() == {"/x": {"/x/secret": False, "/x/keys": True}}
    path.chmod(0o666)  # anyone could have written it: ignored (scanned again)
    assert sandbox._read_shared() == {}
    path.chmod(0o600)
    folder.chmod(0o777)
    assert sandbox._read_shared() == {}
    folder.chmod(0o700)
    link = folder / "link.json"
    link.symlink_to(path)
    monkeypatch.setenv(sandbox.MASKS_ENV, str(link))
    assert sandbox._read_shared() == {}


@pytest.mark.skipif(os.geteuid() != 0, reason="the masks are scanned only as root")
def test_a_grading_run_shares_its_scan_with_the_processes_it_starts(tmp_path, monkeypatch):
    """``share_masks`` writes the scan into the run's folder; a process started with its
    environment (a kernel wrapper) reads it and scans nothing."""
    book = _stand_in_checkout(tmp_path, monkeypatch)
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env = sandbox.share_masks(run)
    assert set(env) == {sandbox.MASKS_ENV} and Path(env[sandbox.MASKS_ENV]).parent == run
    scanned = sandbox._scanned([str(book)])
    monkeypatch.setenv(sandbox.MASKS_ENV, env[sandbox.MASKS_ENV])
    monkeypatch.setattr(sandbox, "_SCANNED", {})
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: pytest.fail(f"scanned again ({name})"))
    monkeypatch.setattr(sandbox, "_unreadable_walk", lambda tree: pytest.fail("scanned again"))
    assert sandbox._scanned([str(book)]) == scanned


def _run_bpf(prog: bytes, arch: int, nr: int) -> int:
    """What the classic-BPF seccomp program returns for one syscall (seccomp_data: nr, arch)."""
    import struct

    insns = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    data, acc, pc = struct.pack("=iI", nr, arch), 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:
            acc = struct.unpack("=I", data[k:k + 4])[0]
        elif code == 0x06:
            return k
        elif code in (0x15, 0x35):
            pc += jt if (acc == k if code == 0x15 else acc >= k) else jf
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")
        pc += 1


@pytest.mark.parametrize("machine", sorted(sandbox._NO_EFFECT_SYSCALLS))
def test_the_seccomp_program_answers_each_syscall(machine):
    """Every listed syscall (chmod, chown, xattr family) returns 0 without effect; io_uring's fail;
    any other of the machine's runs; one through another architecture's entry point (x86's 32-bit,
    x32) fails."""
    arch, numbers = sandbox._NO_EFFECT_SYSCALLS[machine]
    prog = sandbox._seccomp_program(machine)
    allow, no_effect, eperm = 0x7FFF0000, 0x00050000, 0x00050001
    for nr in numbers:
        assert _run_bpf(prog, arch, nr) == no_effect, nr
    for nr in sandbox._REFUSED_SYSCALLS:
        assert _run_bpf(prog, arch, nr) == eperm, nr
    others = [n for n in range(0, 470) if n not in numbers and n not in sandbox._REFUSED_SYSCALLS]
    assert {_run_bpf(prog, arch, n) for n in others} == {allow}
    assert _run_bpf(prog, 0x40000003, 15) == eperm  # i386's chmod
    assert _run_bpf(prog, arch, 0x40000000 | 90) == eperm  # x32
    assert sandbox._seccomp_program("sparc64") is None


@needs_root_bwrap
def test_root_sandbox_cannot_change_a_files_mode_owner_or_attributes(tmp_path):
    """Graded as root, uid 0 inside owns root's files it can reach, the host's device nodes in its
    /dev among them (chmod needs no capability for an owner): mode, owner and extended attributes
    stay as they are, while writing, copying and /dev/null keep working."""
    folder = tmp_path / "work"
    folder.mkdir()
    target = folder / "f"
    target.write_text("x")
    target.chmod(0o644)
    code = textwrap.dedent(f'''
        import os, shutil
        path, seen = {str(target)!r}, []
        os.chmod(path, 0o600)
        os.chown(path, 1000, 1000)
        os.setxattr(path, "user.planted", b"1")
        os.chmod("/dev/null", 0o666)
        shutil.copy(path, path + ".copy")
        open("/dev/null", "w").write("still a device")
        filtered = [line.split()[1] for pid in ("1", "self") for line in open(f"/proc/{{pid}}/status")
                    if line.startswith("Seccomp:")]  # bwrap's init too: else learner code drives it (ptrace)
        print("SEEN", oct(os.stat(path).st_mode & 0o777), os.stat(path).st_uid, os.listxattr(path), filtered, "END")
    ''')
    argv = sandbox.bwrap_argv([sys.executable, "-c", code], writable=[folder])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert re.search(r"SEEN (.*) END", out.stdout).group(1) == "0o644 0 [] ['2', '2']", (out.stdout, out.stderr)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644 and target.stat().st_uid == 0
    assert (folder / "f.copy").read_text() == "x"
    assert stat.S_IMODE(os.stat("/dev/null").st_mode) == 0o666
