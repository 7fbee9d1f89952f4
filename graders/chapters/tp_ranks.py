"""Running a learner's per-rank function in real tensor-parallel ranks: chapter 10's graders.

A collective exercise (ch10.3, ch10.4) is a function one rank runs: it reads its shard and calls
``torch.distributed`` collectives on ``group``. The grader's child (sandboxed, CPU) forks ``tp``
processes per case, joins them in a gloo group (rendezvous through a file in a private temporary
folder, loopback TCP: no port to clash and no network), calls the learner's function on each rank's
arguments and collects every rank's result. Fork, not spawn: the learner's function exists only in
the child that executed the answer cell, and a forked rank inherits it (and torch, already
imported) at the cost of a few tens of milliseconds.

The tensor-parallel ranks are a SUBGROUP: the job has one more process (global rank 0, a bystander
that only joins), and ``group`` holds global ranks 1..tp, so an answer that ignores ``group`` (the
default group is the whole job) is caught, as in a server whose attention-TP group is not the world
(SGLang PR 32708 fixed a row-parallel LoRA all-reducing over the wrong group). In each rank the
collectives are wrapped for the call: one on another group than ``group`` fails at once with a
message (a courtesy: such a collective would wait for the bystander, and the hang is reported anyway).

What the collectives carry is NOT observed or graded (issue #31): anything recorded in a rank sits
next to learner code, which can call an unwrapped primitive and write the expected record itself;
no process that never runs learner code sees the ranks' traffic. Graded is what the ranks return.

What can go wrong in a rank, and what the grader reports: an exception (re-raised in the child with
the rank named, so a case whose contract is ``ValueError`` still sees ``ValueError``; when only some
ranks raise, that is the failure: the others would wait in a collective forever); an input modified
in place (each rank checks its arguments after the call); a result that is not a tensor; a rank that
never finishes (a collective that only some ranks call, or called in a different order): after
``RANK_TIMEOUT_S`` every rank is killed and the case fails saying so. Ranks die with the child
(``PR_SET_PDEATHSIG``), so a killed grader leaves no process behind.

What the grader saw the ranks DO (a rank that waited in a collective, raised alone, changed an input,
used another group) is raised as :class:`GraderObservation`, never as an exception class the
learner's code could have raised itself: the checking machine recognises the class by its name
(``graders.machine.core.OBSERVED``) and reports "the grader observed: ...", not "your function
raised RuntimeError: ..." (a learner once read the latter as an error of their own code).

The expected results never come from forked processes: the graders' references simulate the ranks
in one process (the notebook's kernel must not fork: Python warns on stderr when a multi-threaded
process forks, and nbgrader zeroes a test cell that writes to stderr).
"""
from __future__ import annotations

import builtins
import contextlib
import ctypes
import datetime
import os
import shutil
import signal
import tempfile
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["run_ranks", "RANK_TIMEOUT_S", "GraderObservation"]

#: How long every rank of one case may take, seconds (a tiny layer: milliseconds when correct; the
#: budget covers the gloo rendezvous on a loaded 2-core machine).
RANK_TIMEOUT_S = 6.0
_hung: list[str] = []  # the first hang's message: later cases fail at once instead of hanging too
_PR_SET_PDEATHSIG = 1


class GraderObservation(RuntimeError):
    """What the grader saw the ranks do, not an exception the learner's code raised (the checking
    machine reports it as "the grader observed: <message>"; it knows the class by its name only)."""


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the timeout below still kills the ranks
        pass


#: The collectives and group queries whose group is checked.
_OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter_tensor")


@contextlib.contextmanager
def _watched(tp_group, as_tp: tuple | None = None):
    """For a ``with`` block: the collectives of ``_OPS`` and the group queries refuse any group but
    ``tp_group``. A collective outside ``_OPS`` on the wrong group is not named: it waits for the
    bystander, and the hang is reported. ``as_tp`` (rank, tp): the queries answer these for
    ``tp_group`` (the before-any-collective probe's group also holds the bystander)."""
    saved = {name: getattr(dist, name) for name in _OPS + ("get_rank", "get_world_size")}

    def on(name: str, group):
        if as_tp is not None and name not in ("get_rank", "get_world_size"):
            # the probe's group holds the bystander, which never joins: wait there as a real
            # collective would (whatever the tensors' shapes), until the parent sees the rank pending
            while True:
                time.sleep(1)
        if group is not tp_group:
            what = "the default group (every process of this job)" if group in (None, dist.group.WORLD) else "another group"
            raise GraderObservation(f"torch.distributed.{name} on {what}, not on `group` (the "
                               f"{saved['get_world_size'](tp_group)} tensor-parallel ranks): pass group=group to "
                               "every collective and query")
        return group

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return saved["all_reduce"](tensor, op=op, group=on("all_reduce", group), async_op=async_op)

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        return saved["all_gather"](tensor_list, tensor, group=on("all_gather", group), async_op=async_op)

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        return saved["all_gather_into_tensor"](output_tensor, input_tensor, async_op=async_op,
                                               group=on("all_gather_into_tensor", group))

    def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        return saved["broadcast"](tensor, src=src, group=on("broadcast", group), async_op=async_op,
                                  group_src=group_src)

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):  # noqa: A002
        return saved["reduce_scatter_tensor"](output, input, op=op, async_op=async_op,
                                              group=on("reduce_scatter_tensor", group))

    def get_rank(group=None):
        rank = saved["get_rank"](on("get_rank", group))
        return rank if as_tp is None else as_tp[0]

    def get_world_size(group=None):
        size = saved["get_world_size"](on("get_world_size", group))
        return size if as_tp is None else as_tp[1]

    for fn in (all_reduce, all_gather, all_gather_into_tensor, broadcast, reduce_scatter_tensor, get_rank,
               get_world_size):
        setattr(dist, fn.__name__, fn)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def _same(a, b) -> bool:
    # torch.equal, not ==: an answer can patch Tensor.__eq__ through type(t) without naming a module
    # (helper-27's review); what it would take here is listed for review (graders.course.tamper)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
                and torch.equal(torch.isnan(a), torch.isnan(b)))
    return a == b


def _rank_body(rank: int, tp: int, folder: str, fn: Callable, rank_args: Callable[[int], tuple],
               names: Sequence[str], before_any_collective: bool = False) -> None:
    """Join the job (global rank ``rank + 1``; ``rank`` -1 is the bystander), build the TP subgroup,
    call, write the outcome, then wait to be killed: a rank never tears its group down itself, so no
    rank's exit can break a collective or a rendezvous another rank is still in (the parent kills
    every process once it has every outcome, or a failure)."""
    _die_with_parent()
    torch.set_num_threads(1)  # the ranks share the child's cores
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the sandbox has loopback only
    outcome: dict = {}
    try:
        store = dist.FileStore(os.path.join(folder, "store"), tp + 1)
        # gloo's own timeout is longer than the parent's: the parent names the hang, not gloo
        dist.init_process_group("gloo", store=store, rank=rank + 1, world_size=tp + 1,
                                timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S + 30))
        group = dist.new_group(list(range(1, tp + 1)))  # every process of the job takes part
        if before_any_collective:  # the bystander is in it and never joins: any collective waits
            group = dist.new_group(list(range(tp + 1)))
        if rank >= 0:
            args = rank_args(rank)
            before = [a.clone() if isinstance(a, torch.Tensor) else list(a) if isinstance(a, list) else a for a in args]
            with _watched(group, (rank, tp) if before_any_collective else None):
                result = fn(*args, group)
            changed = [n for n, a, b in zip(names, args, before) if not _same(a, b)]
            if changed:
                raise GraderObservation(f"your function modified its input {changed[0]!r} on rank {rank}; inputs must stay "
                                   "unchanged (a pool's buffers are read again by the next batch)")
            if isinstance(result, torch.Tensor):
                outcome = {"tensor": result.detach().cpu().contiguous()}
            else:
                outcome = {"type": type(result).__name__, "repr": repr(result)[:200]}
        else:
            outcome = {"bystander": True}
    except BaseException as exc:  # noqa: BLE001 - every failure of learner code is reported, not raised here
        name = type(exc).__name__
        if name == GraderObservation.__name__ and type(exc) is not GraderObservation:
            name = "Exception"  # the answer's own class of that name: reported as what it raised
        outcome = {"exc": name, "msg": str(exc)[:2000]}
    path = os.path.join(folder, f"rank{rank}.pt")
    torch.save(outcome, path + ".part")
    os.replace(path + ".part", path)  # the parent never reads a half-written outcome
    while True:
        signal.pause()


#: What gloo says when the rank at the other end of a collective has left the group.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _raise_from_rank(rank: int, outcome: dict) -> None:
    if outcome["exc"] == GraderObservation.__name__:  # a check of the grader's, in the rank
        raise GraderObservation(f"rank {rank}: {outcome['msg']}")
    cls = getattr(builtins, outcome["exc"], None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = RuntimeError
    if any(p in outcome["msg"] for p in _PEER_GONE):
        raise GraderObservation(
            f"rank {rank}: a collective failed because another rank had already left the group (gloo: "
            f"{next(p for p in _PEER_GONE if p in outcome['msg'])}): the ranks called different collectives, "
            "e.g. one inside an if that differs per rank, or a rank that returned before the others")
    raise cls(f"rank {rank}: {outcome['exc']}: {outcome['msg']}")


def run_ranks(tp: int, fn: Callable, rank_args: Callable[[int], tuple], names: Sequence[str] = (),
              before_any_collective: bool = False) -> torch.Tensor:
    """``fn(*rank_args(j), group)`` on each of ``tp`` forked gloo ranks; their tensors stacked, [tp, ...].

    ``names`` name ``rank_args``' entries in messages. ``before_any_collective``: for inputs the
    contract refuses "before any collective", ``group`` also holds the bystander, which never joins a
    collective: an answer that checks first raises on every rank at once; one that calls a collective
    before its check waits there until the deadline, and the case fails saying so. Observed by the
    parent (which runs no learner code) from which ranks finished: nothing recorded in a rank decides.
    Raises:
        the exception a rank raised (same class when it is a built-in exception, else RuntimeError),
            with "rank j:" before its message;
        GraderObservation: what the grader saw the ranks do: only some ranks raised; a refused input
            met a collective before any rank raised; a rank modified an input or used another group
            than ``group``; a collective failed because a peer had left; some rank did not finish
            within ``RANK_TIMEOUT_S`` (every rank is killed; once that happened in this process, every
            later call raises it at once: the same mistake would hang every case, and the exercise's
            time budget would stop the grading before the report);
        TypeError: a rank returned something other than a tensor, or ranks returned tensors of
            different shapes or dtypes (which stacking would hide).
    """
    if _hung:
        raise GraderObservation(f"not run: an earlier case's ranks hung ({_hung[0]})")
    folder = tempfile.mkdtemp(prefix="tp-ranks-")
    pids: list[int] = []
    try:
        for rank in range(-1, tp):  # -1: the bystander (global rank 0)
            pid = os.fork()
            if pid == 0:  # a rank: never returns into the grader's code
                code = 0
                try:
                    _rank_body(rank, tp, folder, fn, rank_args, names, before_any_collective)
                except BaseException:  # noqa: BLE001
                    code = 1
                os._exit(code)
            pids.append(pid)
        outcomes = _wait(pids, folder, not before_any_collective)[1:]
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        shutil.rmtree(folder, ignore_errors=True)
    if before_any_collective and any("pending" in o for o in outcomes) and not any("exc" in o for o in outcomes):
        waiting = [j for j, o in enumerate(outcomes) if "pending" in o]
        raise GraderObservation(
            f"rank(s) {waiting} entered a collective without raising first: for this input, which the contract "
            f"refuses, the grader gave the ranks a group that also holds a process that never joins, so every "
            f"collective waits; these ranks waited in one for {RANK_TIMEOUT_S:g} s, where every rank must raise "
            "ValueError BEFORE any collective (in a server, a rank that raises while another already waits in an "
            "all-reduce hangs the group)")
    died = [j for j, o in enumerate(outcomes) if o.get("died")]
    if died:
        _raise_from_rank(died[0], outcomes[died[0]])
    raised = [j for j, o in enumerate(outcomes) if "exc" in o]
    if raised and len(raised) < tp:
        j, others = raised[0], [k for k in range(tp) if k not in raised]
        how = "did not finish (waiting in a collective that rank never joins)" if any(
            "pending" in outcomes[k] for k in others) else "returned normally"
        first = outcomes[j]
        message = (f"rank {j} raised {first['exc']}: {first['msg'][:300]}, but rank(s) {others} {how}: "
                   "an error the contract names is raised on EVERY rank, before any collective")
        if "did not finish" in how and not before_any_collective:  # (the probe's group makes them wait)
            _hung.append(message)  # the same answer would leave a rank waiting in every later case
        observed = [k for k in raised if outcomes[k]["exc"] == GraderObservation.__name__]
        if observed:  # a grader's check in a rank (an input changed, another group): what it saw
            _raise_from_rank(observed[0], outcomes[observed[0]])
        raise GraderObservation(message)
    for rank in raised:
        _raise_from_rank(rank, outcomes[rank])
    for rank, outcome in enumerate(outcomes):
        if "tensor" not in outcome:
            raise TypeError(f"rank {rank} returned {outcome['type']} {outcome['repr']}; the contract returns a tensor")
    tensors = [o["tensor"] for o in outcomes]
    if len({(tuple(t.shape), t.dtype) for t in tensors}) > 1:
        raise TypeError("the ranks returned tensors of different shapes or dtypes: "
                        + ", ".join(f"rank {j} {list(t.shape)} {t.dtype}" for j, t in enumerate(tensors)))
    return torch.stack(tensors)


def _wait(pids: list[int], folder: str, record_hang: bool = True) -> list[dict]:
    """Every process's outcome (file ``rank{j}.pt`` for j = -1 .. tp-1, in ``pids`` order), read as
    soon as it is written. When a rank failed, the others get until the deadline to fail too (a
    contract error is raised on every rank); a rank still running then is marked ``pending``. A
    process that ended without an outcome is a failure at once."""
    deadline = time.monotonic() + RANK_TIMEOUT_S
    done: dict[int, dict] = {}
    while len(done) < len(pids):
        for k, pid in enumerate(pids):
            if k in done:
                continue
            path = os.path.join(folder, f"rank{k - 1}.pt")
            if os.path.exists(path):
                done[k] = torch.load(path, weights_only=True)
            elif os.waitpid(pid, os.WNOHANG)[0]:
                done[k] = {"exc": GraderObservation.__name__, "msg": "the rank's process ended without a result "
                           "(os._exit, sys.exit or a crash in the answer?)", "died": True}
                return [done.get(j, {"pending": True}) for j in range(len(pids))]
        if len(done) < len(pids):
            if time.monotonic() > deadline:
                if any("exc" in o for o in done.values()) or not record_hang:
                    return [done.get(j, {"pending": True}) for j in range(len(pids))]
                waiting = [j - 1 for j in range(len(pids)) if j not in done]
                returned = sorted(j - 1 for j in done if j > 0)
                _hung.append(
                    f"rank(s) {waiting} did not finish within {RANK_TIMEOUT_S:g} s while rank(s) "
                    f"{returned or 'none'} returned: a collective that only some ranks call (inside an if "
                    "that differs per rank?), or collectives called in a different order on different ranks")
                raise GraderObservation(_hung[0])
            time.sleep(0.002)
    return [done[j] for j in range(len(pids))]
