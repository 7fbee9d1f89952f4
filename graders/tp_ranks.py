"""Running a learner's per-rank function in real tensor-parallel ranks: chapter 10's graders.

A collective exercise (ch10.3, ch10.4) is a function one rank runs: it reads its shard and calls
``torch.distributed`` collectives on ``group``. The grader's child (sandboxed, CPU) forks ``tp``
processes per case, joins them in a gloo group (rendezvous through a file in a private temporary
folder, loopback TCP: no port to clash and no network), calls the learner's function on each rank's
arguments and collects every rank's result. Fork, not spawn: the learner's function exists only in
the child that executed the answer cell, and a forked rank inherits it (and torch, already
imported) at the cost of a few tens of milliseconds.

What can go wrong in a rank, and what the grader reports: an exception (re-raised in the child with
the rank named, so a case whose contract is ``ValueError`` still sees ``ValueError``); a result that
is not a tensor; a rank that never finishes (a collective that only some ranks call, or called in a
different order): after ``RANK_TIMEOUT_S`` every rank is killed and the case fails with a
``TimeoutError`` saying so. Ranks die with the child (``PR_SET_PDEATHSIG``), so a killed grader
leaves no process behind.

The expected results never come from forked processes: the graders' references simulate the ranks
in one process (the notebook's kernel must not fork: Python warns on stderr when a multi-threaded
process forks, and nbgrader zeroes a test cell that writes to stderr).
"""
from __future__ import annotations

import builtins
import ctypes
import datetime
import os
import shutil
import signal
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["run_ranks", "RANK_TIMEOUT_S"]

#: How long every rank of one case may take, seconds (a tiny layer: milliseconds when correct; the
#: budget covers the gloo rendezvous on a loaded 2-core machine).
RANK_TIMEOUT_S = 6.0
_hung: list[str] = []  # the first hang's message: later cases fail at once instead of hanging too
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the timeout below still kills the ranks
        pass


def _rank_body(rank: int, tp: int, folder: str, call: Callable[[int, object], object]) -> None:
    """Join the group, call, write the outcome, then wait to be killed: a rank never tears its group
    down itself, so no rank's exit can break a collective or a rendezvous another rank is still in
    (the parent kills every rank once it has every outcome, or one failure)."""
    _die_with_parent()
    torch.set_num_threads(1)  # tp ranks share the child's cores
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the sandbox has loopback only
    outcome: dict = {}
    try:
        store = dist.FileStore(os.path.join(folder, "store"), tp)
        # gloo's own timeout is longer than the parent's: the parent names the hang, not gloo
        dist.init_process_group("gloo", store=store, rank=rank, world_size=tp,
                                timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S + 30))
        result = call(rank, dist.group.WORLD)
        if isinstance(result, torch.Tensor):
            outcome = {"tensor": result.detach().cpu().contiguous()}
        else:
            outcome = {"type": type(result).__name__, "repr": repr(result)[:200]}
    except BaseException as exc:  # noqa: BLE001 - every failure of learner code is reported, not raised here
        outcome = {"exc": type(exc).__name__, "msg": str(exc)[:2000]}
    path = os.path.join(folder, f"rank{rank}.pt")
    torch.save(outcome, path + ".part")
    os.replace(path + ".part", path)  # the parent never reads a half-written outcome
    while True:
        signal.pause()


#: What gloo says when the rank at the other end of a collective has left the group.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _raise_from_rank(rank: int, outcome: dict) -> None:
    cls = getattr(builtins, outcome["exc"], None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = RuntimeError
    if any(p in outcome["msg"] for p in _PEER_GONE):
        raise RuntimeError(
            f"rank {rank}: a collective failed because another rank had already left the group (gloo: "
            f"{next(p for p in _PEER_GONE if p in outcome['msg'])}): the ranks called different collectives, "
            "e.g. one inside an if that differs per rank, or a rank that returned before the others")
    raise cls(f"rank {rank}: {outcome['exc']}: {outcome['msg']}")


def run_ranks(tp: int, call: Callable[[int, object], object]) -> torch.Tensor:
    """``call(rank, group)`` in ``tp`` forked gloo ranks; returns their tensors stacked, [tp, ...].

    Raises:
        the exception a rank raised (the first rank's, by rank order; same class when it is a
        built-in exception, else RuntimeError), with "rank j:" before its message;
        TypeError: a rank returned something other than a tensor, or ranks returned tensors of
            different shapes or dtypes (which stacking would hide);
        TimeoutError: some rank did not finish within ``RANK_TIMEOUT_S`` (every rank is killed); once
            that happened in this process, every later call raises it at once (the same mistake would
            hang every case, and the exercise's time budget would stop the grading before the report).
    """
    if _hung:
        raise TimeoutError(f"not run: an earlier case's ranks hung ({_hung[0]})")
    folder = tempfile.mkdtemp(prefix="tp-ranks-")
    pids: list[int] = []
    try:
        for rank in range(tp):
            pid = os.fork()
            if pid == 0:  # the rank: never returns into the grader's code
                code = 0
                try:
                    _rank_body(rank, tp, folder, call)
                except BaseException:  # noqa: BLE001
                    code = 1
                os._exit(code)
            pids.append(pid)
        outcomes = _wait(pids, folder)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        shutil.rmtree(folder, ignore_errors=True)
    for rank, outcome in enumerate(outcomes):
        if "exc" in outcome and not outcome.get("stopped"):
            _raise_from_rank(rank, outcome)
    for rank, outcome in enumerate(outcomes):
        if "tensor" not in outcome:
            raise TypeError(f"rank {rank} returned {outcome['type']} {outcome['repr']}; the contract returns a tensor")
    tensors = [o["tensor"] for o in outcomes]
    if len({(tuple(t.shape), t.dtype) for t in tensors}) > 1:
        raise TypeError("the ranks returned tensors of different shapes or dtypes: "
                        + ", ".join(f"rank {j} {list(t.shape)} {t.dtype}" for j, t in enumerate(tensors)))
    return torch.stack(tensors)


def _wait(pids: list[int], folder: str) -> list[dict]:
    """Every rank's outcome, read as soon as it is written; stops early when one rank failed (the
    others may wait on it forever) or a rank's process ended without an outcome."""
    deadline = time.monotonic() + RANK_TIMEOUT_S
    done: dict[int, dict] = {}
    while len(done) < len(pids):
        for rank, pid in enumerate(pids):
            if rank in done:
                continue
            path = os.path.join(folder, f"rank{rank}.pt")
            if os.path.exists(path):
                done[rank] = torch.load(path, weights_only=True)
            elif os.waitpid(pid, os.WNOHANG)[0]:
                done[rank] = {"exc": "RuntimeError", "msg": "the rank's process ended without a result "
                              "(os._exit, sys.exit or a crash in the answer?)"}
            if "exc" in done.get(rank, {}):
                return [done.get(j, {"exc": "RuntimeError", "msg": "stopped: another rank failed", "stopped": True})
                        for j in range(len(pids))]
        if len(done) < len(pids):
            if time.monotonic() > deadline:
                waiting = [j for j in range(len(pids)) if j not in done]
                _hung.append(
                    f"rank(s) {waiting} did not finish within {RANK_TIMEOUT_S:g} s while rank(s) "
                    f"{sorted(done) or 'none'} returned: a collective that only some ranks call (inside an if "
                    "that differs per rank?), or collectives called in a different order on different ranks")
                raise TimeoutError(_hung[0])
            time.sleep(0.002)
    return [done[j] for j in range(len(pids))]
