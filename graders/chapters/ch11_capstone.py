"""Chapter 11's capstone (ch11.5): the learner's own control plane and engine step, judged end to end.

The learner writes ``engine_step(scheduler, runner)``: one step of the engine (schedule, run the model
on the step's work, pick the greedy token of every row that reached its sequence's end, record). The
grader builds the book's engine (``reference.engine.LLM``) with the learner's ch11.1 ``block_hashes``,
ch11.2 ``admit_requests`` and ch11.3 ``choose_drain`` as its policies (``EnginePolicies``; their
answer cells come with the step's in an answer bundle: ``graders.machine.needs``) and serves a workload with
``LLM.generate(..., step=engine_step)``: a tiny Llama (one layer, fp32, on the CPU), PEFT adapters of
different ranks and targets, base requests.

The judge, per case (:func:`compare_run`):

- every request's greedy tokens equal the reference engine's, which tests/test_capstone.py shows
  equal to PEFT's own ``generate`` of each request alone on the public cases and on hidden draws;
- the engine's log equals the reference's step by step, the first difference reported (chapter
  05's method). One line per step: what the scheduler did (admissions, prefill chunks with their
  start, which is where a prefix-cache hit shows, decodes, preemptions, drains, finishes) and what
  the pool did (the adapters it kept resident, loaded, evicted). A policy mistake that happens to
  give the same tokens still fails where it changes the schedule.

What crosses between the processes is data (DESIGN.md): a case is one workload (the model's config
and weights, each adapter's ``adapter_config.json`` text and tensors, the engine's config, the
requests); the driver returns ``(log lines, tokens per request, suspects)``. Suspects are, per
policy, the first call whose result differed from the reference policy on the same inputs, recorded
in the child beside the call (inputs and results as plain data). They never count for the score
(only the log and the tokens do); a hint re-checks a suspect against the reference here before it
names it, and then adds that exercise's own hint (``graders.chapters.ch11``). The child's record is
data the answer may have replaced: a record the case's engine could not have made (more calls than
pieces, lists longer than the case's requests, uids of no adapter, other types or limits) fails the
case as malformed before anything is replayed, so the comparer's work never grows with what the
child sent (:func:`_checked_suspects`, ``MAX_HINTED_RESULT_ITEMS``). A piece that raises, hangs, or
is missing stops the run with a log line naming it (its id and function), never a crash; the
expected run (the reference, here) has no such line.

Case design (graders' rule, every clause of ch11.5's Semantics and of the engine it drives): every
run starts with step 0, the learner's step called before any request arrives ("idle", and the
runner not called: its log line says what the step returned and how often it called the runner).
The edge group is one workload per clause family, smallest first: a base request alone (schedule,
forward, argmax, postprocess, the step's kind); a prompt longer than the token budget beside a
decoding base request and a decoding adapter request (chunk starts and positions, no token for a
chunk short of its end, the base model among the running uids of a prefill step); one prompt
under two adapters that both change K/V, one request at a time (the adapter in the block key, a
legitimate full-prefix hit of the same adapter); prompts with equal blocks after different prefixes
and all-equal blocks (chained keys); more adapters than slots with base requests and a CPU tier of
one (the cap with the base model counted, warm-first admission, evictions, the running adapters
kept resident while they decode beside a prefill); a KV cache small enough to preempt (recompute,
KV stopping admission in arrival order); a rare adapter starving behind a hot one with a drain
threshold (the drain, its victim, its end); a model whose next-token logits tie in pairs (ties to
the lower id). The random and hidden groups draw each family again
(adapter names, kinds, token ids, lengths, sizes) plus one mixed workload, so a mistake costs the
same under any secret.
"""
from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import tempfile
import threading
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from graders.chapters.ch11 import (_admit_case, _admit_hint, _drain_case, _drain_hint, _hash_case, _hash_hint, drive_admit,
                          drive_drain)
from graders.chapters.hints import first_difference
from graders.machine.exercise import Case, Exercise
from graders.machine.runner import main_thread_alarm
from reference.engine.policies import admit_requests, block_hashes, choose_drain
from reference.mem_pool import uid_sort_key

__all__ = ["EXERCISES", "drive_engine", "compare_run", "MODEL_CONFIG", "ADAPTER_KINDS", "PIECES", "workload_case",
           "peft_files", "base_weights"]

#: The tiny Llama every case serves (fp32, CPU): one layer keeps a case near 0.1 s.
MODEL_CONFIG = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=96, vocab_size=128, max_position_embeddings=64)
#: PEFT LoraConfig of each adapter kind the workloads draw from: ranks 1-16, every kind of target.
ADAPTER_KINDS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "kv": dict(r=8, lora_alpha=16, target_modules=["k_proj", "v_proj"]),
    "all": dict(r=16, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "mlp": dict(r=6, lora_alpha=12, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "qkvo": dict(r=12, lora_alpha=6, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "o": dict(r=2, lora_alpha=3, target_modules=["o_proj", "down_proj"]),
    "q1": dict(r=1, lora_alpha=4, target_modules=["q_proj"]),
}
#: Kinds whose LoRA changes K and V (what a block key without the adapter would share wrongly).
KV_KINDS = ("kv", "all", "qkvo")
#: The needed exercises and the EnginePolicies field each one fills.
PIECES = {"ch11.1": "block_hashes", "ch11.2": "admit_requests", "ch11.3": "choose_drain"}
_REFERENCE_POLICIES = {"ch11.1": block_hashes, "ch11.2": admit_requests, "ch11.3": choose_drain}
#: Seconds one case may run in the grader's child before the piece running then is named as hung.
CASE_SECONDS = 10.0
_CHILD_ENV = "LORA_BOOK_GRADER_CHILD"


# ---------------------------------------------------------------------------------------------
# The model and the adapters (built here, in the comparer; they cross to the child as data)


#: transformers' lazy top-level names are not safe to import from several threads at once (the
#: trusted re-grade builds cases in a thread pool: "cannot import name 'LlamaConfig'" seen there),
#: and the weights below are drawn from torch's global RNG: one thread at a time.
_IMPORT_LOCK = threading.RLock()


def _tiny_llama(weights: Optional[dict] = None, config: Optional[dict] = None):
    """A LlamaForCausalLM of ``config`` (default MODEL_CONFIG), with ``weights`` (a state dict) when given."""
    with _IMPORT_LOCK:
        from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**(config or MODEL_CONFIG)))
    if weights is not None:
        model.load_state_dict(weights)
    return model.eval()


@functools.lru_cache(maxsize=4)
def base_weights(seed: int) -> dict:
    """The base model's state dict {name: tensor} for ``seed`` (the caller's RNG untouched)."""
    with _IMPORT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return {k: v.clone() for k, v in _tiny_llama().state_dict().items()}


@functools.lru_cache(maxsize=64)
def peft_files(seed: int, kind: str) -> dict:
    """One PEFT adapter of ``kind`` over the base model of ``seed``, as PEFT saves it:
    {"config_json": the adapter_config.json text, "weights": {safetensors key: tensor}}.
    Its random weights (``init_lora_weights=False``) come from ``seed`` and the kind."""
    with _IMPORT_LOCK:
        import peft
    from safetensors.torch import load_file

    with _IMPORT_LOCK, torch.random.fork_rng(devices=[]), warnings.catch_warnings(), \
            tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")
        torch.manual_seed(seed * 1000 + sorted(ADAPTER_KINDS).index(kind))
        model = peft.get_peft_model(_tiny_llama(base_weights(seed)),
                                    peft.LoraConfig(init_lora_weights=False, **ADAPTER_KINDS[kind]))
        model.save_pretrained(tmp)
        return {"config_json": (Path(tmp) / "adapter_config.json").read_text(),
                "weights": load_file(str(Path(tmp) / "adapter_model.safetensors"))}


def tied_weights(seed: int) -> dict:
    """:func:`base_weights` with output rows in equal pairs: rows 2k and 2k+1 of lm_head both read only
    hidden unit k, with the same weight, so every next-token choice is a tie between two ids, which
    greedy decoding breaks towards the lower one (``torch.argmax``, as PEFT's ``generate``). One
    nonzero per row makes each logit one product plus exact zeros: bit-equal within a pair whatever
    order a matmul kernel sums in (equal dense rows were not: PEFT's kernel split such ties)."""
    weights = dict(base_weights(seed))
    head = torch.zeros_like(weights["lm_head.weight"])
    vocab, hidden = head.shape
    gen = torch.Generator().manual_seed(seed + 7)
    scale = 3 * torch.randn(vocab // 2, generator=gen)
    for k in range(vocab // 2):
        head[2 * k, k % hidden] = head[2 * k + 1, k % hidden] = scale[k]
    weights["lm_head.weight"] = head
    return weights


def workload_case(name: str, adapters: dict, engine: dict, requests: list, seed: int = 0,
                  tied: bool = False) -> Case:
    """A ch11.5 case: ``adapters`` {name: kind}, ``engine`` EngineConfig fields, ``requests`` as
    (prompt token ids, adapter name or None, max_new_tokens, stop token ids); ``tied``: the model's
    next-token logits come in equal pairs (:func:`tied_weights`)."""
    workload = {
        "model": {"config": dict(MODEL_CONFIG), "weights": tied_weights(seed) if tied else base_weights(seed)},
        "adapters": {a: dict(peft_files(seed, kind), kind=kind) for a, kind in adapters.items()},
        "engine": dict(engine),
        "requests": [[list(p), a, int(n), list(stops)] for p, a, n, stops in requests],
    }
    return Case(name, [workload], _describe(workload), op="exact")


def _describe(workload: dict) -> str:
    reqs, eng = workload["requests"], workload["engine"]
    per = Counter("base" if a is None else a for _, a, _, _ in reqs)
    kinds = ", ".join(f"{a} ({v['kind']}: {_targets(v['kind'])})" for a, v in workload["adapters"].items())
    lens = [len(p) for p, _, _, _ in reqs]
    drain = (f"drain after {eng['drain_threshold']} steps waiting" if eng.get("drain_threshold") is not None
             else "no drain")
    return (f"{len(reqs)} requests ({', '.join(f'{k} x{v}' for k, v in per.items())}), prompts of "
            f"{min(lens)}-{max(lens)} tokens, {min(r[2] for r in reqs)}-{max(r[2] for r in reqs)} new tokens; "
            f"adapters {kinds or 'none'}; {eng['max_loras_per_batch']} GPU slots (the base model takes one), "
            f"CPU tier {eng.get('max_loaded_loras') or 'unbounded'}, {eng['num_kv_blocks']} KV blocks of "
            f"{eng['block_size']}, "
            f"{eng['max_num_batched_tokens']}-token budget, {eng['max_num_seqs']} sequences at most, {drain}")


def _targets(kind: str) -> str:
    kw = ADAPTER_KINDS[kind]
    t = kw["target_modules"]
    return f"r{kw['r']} on {t if isinstance(t, str) else '/'.join(x.removesuffix('_proj') for x in t)}"


# ---------------------------------------------------------------------------------------------
# The driver: runs in the grader's child next to the learner's code, returns plain data


class _Stop(BaseException):
    """Ends a run from inside the engine (a guard, or a piece that failed). A BaseException, so that
    an ``except Exception`` in learner code does not swallow it; the run also remembers why."""


class _Hung(BaseException):
    """Raised by the case's alarm in the grader's child."""


class _Run:
    """What one run records: log lines, the step number, what code is running now, suspects."""

    def __init__(self) -> None:
        self.step = 0
        self.lines: list[str] = []
        self.active: list[str] = []  # "your admit_requests (ch11.2)", innermost last
        self.suspects: dict[str, tuple] = {}
        self.failure: Optional[str] = None

    def fail(self, message: str) -> _Stop:
        if self.failure is None:
            self.failure = message
        return _Stop(message)


def _as_data(value: Any) -> Any:
    """A learner's result as plain data for the report, without consuming it (a generator stays a
    generator for the engine). A tuple stays a tuple and a list a list, so a report prints the
    result as it was returned (``_differs`` compares them alike)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_as_data(v) for v in value) if type(value) in (list, tuple) else [_as_data(v) for v in value]
    return f"<a {type(value).__name__}>"


def _listed(value: Any) -> Any:
    """Plain data with every tuple a list (for comparing: a pair returned as a list is accepted)."""
    return [_listed(v) for v in value] if isinstance(value, (list, tuple)) else value



def _args_data(exercise_id: str, args: tuple) -> list:
    """The policy's inputs as plain data, in the shape of the exercise's own cases (graders.chapters.ch11)."""
    if exercise_id == "ch11.1":
        tokens, uid, size = args
        return [[int(t) for t in tokens], uid, size]
    rows = [[c.seq_id, c.uid, c.blocks_needed, c.waited] for c in args[0]]
    if exercise_id == "ch11.2":
        running, resident, cap, free, max_new, draining, active = args[1:]
        return [rows, list(running), sorted(resident, key=uid_sort_key), cap, free, max_new, draining, active]
    remaining, cap, threshold = args[1:]
    return [rows, [[u, n] for u, n in remaining.items()], cap, threshold]


def _piece_case(exercise_id: str, data: list) -> Case:
    """A case of the needed exercise's own grader built from a recorded call (for its hint)."""
    if exercise_id == "ch11.1":
        return _hash_case("engine_call", *data)
    if exercise_id == "ch11.2":
        return _admit_case("engine_call", *data)
    return _drain_case("engine_call", *data)


#: The reference policy of each piece, called on a recorded call's plain data (the shape of its cases).
_DATA_REFERENCE = {"ch11.1": block_hashes, "ch11.2": functools.partial(drive_admit, admit_requests),
                   "ch11.3": functools.partial(drive_drain, choose_drain)}


def _piece_reference(exercise_id: str, data: list) -> Any:
    """The reference policy's result on a recorded call, as plain data (``["raises", name]`` when it raises)."""
    try:
        return _as_data(_DATA_REFERENCE[exercise_id](*data))
    except Exception as exc:  # noqa: BLE001 (the contract's errors)
        return ["raises", type(exc).__name__]


class _Policy:
    """One of the learner's policies as the engine calls it. Records the first call whose result
    differs from the reference policy's on the same inputs (a suspect); a raise stops the run with
    a line naming the piece, the step and the inputs."""

    def __init__(self, run: _Run, exercise_id: str, fn: Callable) -> None:
        self.run, self.exercise_id, self.fn = run, exercise_id, fn
        self.label = f"your {PIECES[exercise_id]} ({exercise_id})"
        self.checked = fn is not _REFERENCE_POLICIES[exercise_id]

    def __call__(self, *args):
        run = self.run
        if run.failure is not None:
            raise _Stop(run.failure)
        data = _args_data(self.exercise_id, args) if self.checked else None
        run.active.append(self.label)
        try:
            got = self.fn(*args)
        except (_Stop, _Hung):
            raise
        except BaseException as exc:  # SystemExit too: the piece is named, the run ends
            shown = data if data is not None else _args_data(self.exercise_id, args)
            raise run.fail(f"{self.label} raised {_error_text(exc)}; it was called with "
                           f"{_piece_case(self.exercise_id, shown).describe}") from None
        finally:
            run.active.pop()
        if self.checked and self.exercise_id not in run.suspects:
            want, plain = _piece_reference(self.exercise_id, data), _as_data(got)
            if _differs(self.exercise_id, plain, want):
                run.suspects[self.exercise_id] = (self.exercise_id, run.step, data, plain)
        return got


def _differs(exercise_id: str, got: Any, want: Any) -> bool:
    got, want = _listed(got), _listed(want)
    if exercise_id == "ch11.3" and isinstance(got, list) and len(got) == 2 and got[0] is False and want[0] is False:
        return False  # (False, anything): no drain either way
    return got != want


def _error_text(exc: BaseException) -> str:
    """``Type: message -- where``: the innermost answer-cell frame, and the engine's function when the
    error was raised in the engine's code called from the learner's."""
    frames = traceback.extract_tb(exc.__traceback__)
    learner = [f for f in frames if f.filename.startswith("<answer cell")]
    text = (str(exc).splitlines() or [""])[0][:300]
    where = ""
    if learner:
        f = learner[-1]
        where = f"{f.filename.strip('<>')} line {f.lineno}: {f.line}"
        if f is not frames[-1]:  # raised in the engine's code, called from the learner's
            where = f"in {Path(frames[-1].filename).name} ({frames[-1].name}), called from {where}"
    elif frames:
        where = f"in {Path(frames[-1].filename).name} ({frames[-1].name})"
    return f"{type(exc).__name__}: {text}" + (f" -- {where}" if where else "")


def _render(n: int, kind: Any, sched_events: list, pool_events: list, computed: list) -> str:
    """One log line: ``step n (kind): scheduler events; computed: the token count of each
    runner.forward call; pool: what it kept, loaded, evicted``."""
    parts, decodes = [], []
    for e in sched_events:
        if e[0] == "decode":
            decodes.append(f"#{e[1]}")
            continue
        if decodes:
            parts.append("decode " + " ".join(decodes))
            decodes = []
        parts.append({"admit": lambda: f"admit #{e[1]}", "prefill": lambda: f"prefill #{e[1]} [{e[2]}:{e[3]})",
                      "preempt": lambda: f"preempt #{e[1]}", "finish": lambda: f"finish #{e[1]} ({e[2]})",
                      "drain": lambda: f"drain {_uid(e[1])}", "drain_end": lambda: f"drain of {_uid(e[1])} ends"
                      }.get(e[0], lambda: repr(e))())
    if decodes:
        parts.append("decode " + " ".join(decodes))
    pool = []
    for e in pool_events:
        pool.append({"hit": lambda: f"{_uid(e[1])} in slot {e[2]}",
                     "load": lambda: f"load {_uid(e[1])} into slot {e[2]} from {e[3]}",
                     "evict": lambda: f"evict {_uid(e[1])} from slot {e[2]}",
                     "cpu_evict": lambda: f"drop the CPU copy of {_uid(e[1])}"}.get(e[0], lambda: repr(e))())
    kind_text = kind if isinstance(kind, str) else f"returned {_as_data(kind)!r}"
    forward = " + ".join("?" if c is None else str(c) for c in computed) or "no forward"
    return (f"step {n} ({kind_text}): {', '.join(parts) or 'nothing scheduled'}; computed: {forward} tokens; "
            f"pool: {', '.join(pool) or '-'}")


def _uid(uid) -> str:
    return "base" if uid is None else str(uid)


def _state(sched, seqs: dict) -> tuple:
    """What a step must change: each sequence's computed tokens and outputs, and the queues."""
    for s in [*sched.running, *sched.waiting]:
        seqs[s.seq_id] = s
    return (tuple((i, s.num_computed, len(s.output), s.status.value) for i, s in sorted(seqs.items())),
            len(sched.waiting), len(sched.running))


def _recorder(llm, step_fn: Callable, run: _Run, seqs: dict, limit: int) -> Callable:
    """The step ``generate`` calls: the learner's step, then one log line; guards against a step that
    changes nothing and a run that never ends."""
    sched, pool = llm.scheduler, llm.pool

    def step(scheduler, runner):
        run.step += 1
        if run.step > limit:
            raise run.fail(f"still unfinished after {limit} steps (the reference needs far fewer): requests "
                           f"{sorted(s.seq_id for s in [*sched.running, *sched.waiting])} never finish")
        before, marks = _state(sched, seqs), (len(sched.events), len(pool.events))
        computed: list = []  # tokens per runner.forward call: exactly what the step scheduled, no more
        forward = runner.forward

        def counting(work, running=()):  # ModelRunner.forward's signature
            try:
                computed.append(sum(len(w[0]) for w in work))
            except Exception:  # noqa: BLE001 (not SeqWorks: forward itself will say what is wrong)
                computed.append(None)
            return forward(work, running)

        postprocess = scheduler.postprocess

        def checked(work, next_tokens):  # Scheduler.postprocess's signature
            # the contract: a token for every item that reached its sequence's end, none for a chunk
            # short of it (postprocess itself reads only the ones it needs and ignores the rest)
            try:
                ends = {w.seq.seq_id for w in work if w.end == w.seq.num_tokens}
                short = {w.seq.seq_id: (w.end, w.seq.num_tokens) for w in work if w.end != w.seq.num_tokens}
                # (only with every needed token there: a mapping keyed otherwise is told by postprocess)
                extra = sorted(k for k in next_tokens if k in short) if ends <= set(next_tokens) else []
            except Exception:  # noqa: BLE001 (not the expected shapes: postprocess itself says what is wrong)
                extra = []
            if extra:
                k = extra[0]
                raise run.fail(
                    f"your engine_step handed postprocess a token for seq {k}, whose work item is short of its "
                    f"end (it ends at {short[k][0]} of the sequence's {short[k][1]} tokens): an item short of its "
                    f"end gives no token; next_tokens holds a token only for the items with w.end == "
                    f"w.seq.num_tokens (this step: seq_ids {sorted(ends)}), got keys {sorted(next_tokens)}")
            return postprocess(work, next_tokens)

        runner.forward = counting
        scheduler.postprocess = checked
        run.active.append("your engine_step (ch11.5)")
        try:
            kind = step_fn(scheduler, runner)
        except (_Stop, _Hung):
            raise
        except BaseException as exc:
            raise run.fail(f"{_error_text(exc)}") from None
        finally:
            run.active.pop()
            del runner.forward  # the bound method again
            del scheduler.postprocess
        if run.failure is not None:  # a piece failed and the step's code caught it
            raise _Stop(run.failure)
        run.lines.append(_render(run.step, kind, sched.events[marks[0]:], pool.events[marks[1]:], computed))
        if _state(sched, seqs) == before and sched.has_unfinished():
            raise run.fail(f"step {run.step} changed nothing (no token computed or added, nobody admitted) while "
                           f"{len(sched.waiting) + len(sched.running)} requests are unfinished")
        return kind if kind in ("prefill", "decode", "mixed", "idle") else "other"

    return step



def _idle_probe(llm, step_fn: Callable, run: _Run) -> None:
    """Step 0 of every run: the learner's step on the engine before any request arrives. The
    contract: nothing scheduled, so return "idle" without calling the runner. One log line says
    what it returned and how often it called ``runner.forward``."""
    runner, calls = llm.runner, []
    forward = runner.forward

    def counting(work, running=()):  # ModelRunner.forward's signature
        calls.append(1)
        return forward(work, running)

    runner.forward = counting
    run.active.append("your engine_step (ch11.5)")
    try:
        kind = step_fn(llm.scheduler, runner)
        said = f"returned {kind!r}"[:80] if kind is None or isinstance(kind, (str, int, float)) \
            else f"returned a {type(kind).__name__}"
    except (_Stop, _Hung):
        raise
    except BaseException as exc:  # noqa: BLE001 (the learner's step; named in the log line)
        said = f"raised {_error_text(exc)}"[:200]
    finally:
        run.active.pop()
        del runner.forward  # the bound method again
    if run.failure is not None:  # a piece failed on the empty queues
        raise _Stop(run.failure)
    run.lines.append(f"step 0, before any request (nothing to run): {said}; runner.forward called {len(calls)} "
                     f"time(s)")


#: In the grader's child: why an earlier case of this answer hung (later cases then fail at once,
#: instead of each waiting for its alarm and running the check past its budget).
_HUNG: list[str] = []


@contextlib.contextmanager
def _alarm(run: _Run, seconds: float):
    """In the grader's child (its main thread): after ``seconds``, raise :class:`_Hung` in whatever
    runs then, naming the learner's code that was running (the comparer never runs learner code and
    sets no alarm)."""
    if not os.environ.get(_CHILD_ENV):
        yield
        return
    who = lambda: run.active[-1] if run.active else "the engine"  # noqa: E731 (read when it rings)
    with main_thread_alarm(seconds, lambda: _Hung(f"{who()} did not return within {seconds:g} s (an endless loop?)")):
        yield


@contextlib.contextmanager
def _one_thread():
    """Run with one intra-op thread: a tiny model's ops are too small to split (two threads contending
    on two busy cores made a case 3-8 times slower), and the comparer and the child then compute
    the very same bits."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _engine(workload: dict, policies):
    """The book's engine over the workload's model and adapters (PEFT folders written to a private
    temporary folder, registered in the workload's order: uids name@0, name@1, ...)."""
    from safetensors.torch import save_file

    from reference.engine.llm import LLM, EngineConfig

    model = _tiny_llama(workload["model"]["weights"], workload["model"]["config"])
    # prefill-first steps unless a case says otherwise: every prefill step then runs beside decoding
    # sequences that compute nothing, which is what engine_step's `running` contract is graded on
    # (with mixed steps, the engine's default, those sequences are in the step themselves)
    llm = LLM(model, EngineConfig(**{"mixed_steps": False, **workload["engine"]}), policies=policies)
    with tempfile.TemporaryDirectory(prefix="ch11-capstone-") as tmp:
        for name, files in workload["adapters"].items():
            folder = Path(tmp) / name
            folder.mkdir()
            (folder / "adapter_config.json").write_text(files["config_json"])
            save_file(dict(files["weights"]), str(folder / "adapter_model.safetensors"))
            llm.register_adapter(name, folder)
    return llm


def drive_engine(step_fn: Callable, pieces: dict, workload: dict) -> tuple:
    """Serve ``workload`` with the book's engine whose policies are ``pieces`` (ch11.1-ch11.3, each
    a function or a ``graders.machine.needs.PieceUnavailable``) and whose step is ``step_fn``.

    Returns:
        (log, tokens, suspects): one log line per step (``_render``), and a last line
        ``error at step n: ...`` when the run stopped (a piece or the step raised, hung, or was
        missing; a step changed nothing; the run never ended); the greedy tokens of each request
        (what it had when the run stopped); per policy, the first call whose result differed from
        the reference's, as ``(exercise id, step, inputs, result)`` in plain data.
    """
    from graders.machine.needs import PieceUnavailable
    from reference.engine.llm import EnginePolicies
    from reference.engine.sequence import SamplingParams

    requests = workload["requests"]
    missing = [p for i, p in sorted(pieces.items()) if isinstance(p, PieceUnavailable)]
    if missing:
        return ([f"error before step 1: your {p.exercise_id} {PIECES[p.exercise_id]}: {p.message}" for p in missing],
                [[] for _ in requests], [])
    run, seqs = _Run(), {}
    if _HUNG:
        return [f"error before step 1: not run, as in an earlier case {_HUNG[0]}"], [[] for _ in requests], []
    limit = _case_limits(workload)["steps"]
    try:
        with _one_thread(), _alarm(run, CASE_SECONDS):
            llm = _engine(workload, EnginePolicies(**{PIECES[i]: _Policy(run, i, pieces[i]) for i in PIECES}))
            _idle_probe(llm, step_fn, run)
            outs = llm.generate([r[0] for r in requests],
                                [SamplingParams(max_new_tokens=r[2], stop_token_ids=tuple(r[3])) for r in requests],
                                lora_request=[r[1] for r in requests], step=_recorder(llm, step_fn, run, seqs, limit))
        tokens = [list(o.token_ids) for o in outs]
    except _Hung as exc:
        _HUNG.append(f"{exc.args[0]} at step {run.step}")
        run.lines.append(f"error at step {run.step}: {exc.args[0]}")
        tokens = [list(seqs[i].output) if i in seqs else [] for i in range(len(requests))]
    except BaseException as exc:  # noqa: BLE001 (_Stop, or the engine refusing what a step did)
        message = run.failure if isinstance(exc, _Stop) and run.failure else f"the engine raised {_error_text(exc)}"
        run.lines.append(f"error at step {run.step}: {message}")
        tokens = [list(seqs[i].output) if i in seqs else [] for i in range(len(requests))]
    return run.lines, tokens, sorted(run.suspects.values(), key=lambda s: s[1])


# ---------------------------------------------------------------------------------------------
# Comparing (in the comparer: plain data only)


def _well_formed(run: Any) -> bool:
    return (isinstance(run, (list, tuple)) and len(run) == 3 and isinstance(run[0], (list, tuple))
            and all(isinstance(x, str) for x in run[0]) and isinstance(run[1], (list, tuple)))


def _request_label(case: Case, i: int) -> str:
    prompt, adapter, n, stops = case.args[0]["requests"][i]
    return (f"request #{i} ({'base model' if adapter is None else 'adapter ' + repr(adapter)}, "
            f"{len(prompt)}-token prompt, max_new_tokens {n}{', stop ids ' + str(stops) if stops else ''})")


def compare_run(case: Case, expected: tuple, got: Any) -> Optional[str]:
    """What differs between the learner's run and the reference's, or None: the stop (if the run
    stopped), the requests whose tokens differ, and the first step where the logs differ."""
    if not _well_formed(got):
        return "the grader's engine run returned something else than its log and tokens (did the answer patch it?)"
    _checked_suspects(case, got[2])  # raises on a record the engine could not have made: MALFORMED
    e_log, e_tokens, _ = expected
    g_log, g_tokens, _ = got
    d = first_difference(e_log, list(g_log))
    wrong = [i for i in range(len(e_tokens)) if i >= len(g_tokens) or list(g_tokens[i]) != list(e_tokens[i])]
    if d is None and not wrong:
        return None
    lines = []
    stopped = bool(g_log) and g_log[-1].startswith("error")
    if stopped:
        lines.append(f"the run stopped: {g_log[-1]}")
    if wrong:
        i = wrong[0]
        lines.append(f"{len(wrong)} of {len(e_tokens)} requests' tokens differ from PEFT's generate of each request "
                     f"alone; the first, {_request_label(case, i)}: "
                     + _token_difference(list(e_tokens[i]), list(g_tokens[i]) if i < len(g_tokens) else None))
    else:
        lines.append("every request's tokens are right, but the engine's log differs from the reference's")
    if d is not None and not (stopped and d == len(g_log) - 1):
        e_line = e_log[d] if d < len(e_log) else None
        g_line = g_log[d] if d < len(g_log) else None
        lines.append(f"the logs first differ at step {d}, {_line_difference(e_line, g_line)}:"
                     f"\n  expected: {e_line or '(the reference had ended)'}"
                     f"\n  got:      {g_line or '(your run had ended)'}")
    return "\n".join(lines)


def _token_difference(expected: list, got: Optional[list]) -> str:
    """Which generated token of one request first differs: 'its token 2 of 6: expected 58, got 106'."""
    if got is None:
        return f"expected {expected}, got nothing"
    k = first_difference(expected, got)
    if k is None:
        return f"expected {expected}, got {got}"
    if k >= len(got):
        return f"it stopped after {len(got)} of its {len(expected)} tokens: expected {expected}, got {got}"
    if k >= len(expected):
        return f"it went on past its {len(expected)} tokens: expected {expected}, got {got}"
    return (f"its generated token {k} (of {len(expected)}) first differs, expected {expected[k]}, got {got[k]}"
            f"{' (the ones before are right)' if k else ''}: expected {expected}, got {got}")


#: The fields of a log line (graders.chapters.ch11_capstone._render), in the learner's terms.
_LINE_FIELDS = (("kind", "in the step's kind"), ("scheduled", "in what the scheduler did"),
                ("computed", "in the token counts runner.forward computed"), ("pool", "in the adapter pool's events"))


def _fields(line: str) -> dict:
    """'step 3 (decode): decode #0 #1; computed: 2 tokens; pool: base in slot 0' -> its four fields."""
    head, _, rest = line.partition("): ")
    scheduled, _, rest = rest.partition("; computed: ")
    computed, _, pool = rest.partition(" tokens; pool: ")
    return {"kind": head.partition(" (")[2], "scheduled": scheduled, "computed": computed, "pool": pool}


def _line_difference(expected: Optional[str], got: Optional[str]) -> str:
    """Which field of a log line differs first, with its two values; for a run that ended or an
    error line, which one."""
    if expected is None:
        return "where the reference had ended"
    if got is None:
        return "where your run had ended"
    if got.startswith("error"):
        return "where your run stopped with an error"
    e, g = _fields(expected), _fields(got)
    for key, where in _LINE_FIELDS:
        if e[key] != g[key]:
            if key == "scheduled":  # the first event that differs
                ev, gv = e[key].split(", "), g[key].split(", ")
                k = first_difference(ev, gv)
                if k is not None:
                    return (f"{where} (event {k + 1}: expected '{ev[k] if k < len(ev) else '(nothing more)'}', got "
                            f"'{gv[k] if k < len(gv) else '(nothing more)'}')")
            return f"{where} (expected '{e[key]}', got '{g[key]}')"
    return "in its text"


# ---------------------------------------------------------------------------------------------
# Hints: which piece, which step, which mistake


#: The bound on what the comparer does with the child's suspects (trusted work is never sized by
#: child data): a record is checked against what the engine of *this case* could have passed
#: (:func:`_checked_suspects`: at most one call per needed piece, every list no longer than the
#: case's requests, uids or token sequences allow), so a hint replays the reference and its known
#: mistakes at most 3 times, each on inputs no larger than the case's own. The learner's recorded
#: result (what their policy returned: anything) is compared only; one of more than this many items
#: (list entries, or 64 characters of text) is not hinted.
MAX_HINTED_RESULT_ITEMS = 4096


class MalformedSuspect(ValueError):
    """A suspect record that the driver could not have made on this case (the answer replaced it)."""


def _case_limits(workload: dict) -> dict:
    """What the engine serving ``workload`` can pass to a policy (drive_engine's own bounds)."""
    requests, engine = workload["requests"], workload["engine"]
    return {"requests": len(requests), "uids": {None} | {f"{name}@{i}" for i, name in enumerate(workload["adapters"])},
            "tokens": max((len(p) + n for p, _, n, _ in requests), default=0),
            "steps": 4 * sum(len(p) + n for p, _, n, _ in requests) + 40, "block_size": engine["block_size"],
            "cap": engine["max_loras_per_batch"], "kv_blocks": engine["num_kv_blocks"],
            "max_seqs": engine["max_num_seqs"], "threshold": engine.get("drain_threshold")}


def _is_int(x: Any) -> bool:
    return type(x) is int


def _seq(x: Any, most: int, what: str) -> list:
    """``x`` as a list (the wire gives a list or a tuple) of at most ``most`` entries, else malformed."""
    if type(x) not in (list, tuple):
        raise MalformedSuspect(f"{what} is a {type(x).__name__}, not a list")
    if len(x) > most:
        raise MalformedSuspect(f"{what} has {len(x)} entries; this case's engine passes at most {most}")
    return list(x)


def _check_uid(u: Any, limits: dict, what: str) -> None:
    if not (u is None or type(u) is str and u in limits["uids"]):
        raise MalformedSuspect(f"{what} is no uid of this case's adapters")


def _check_rows(rows: Any, limits: dict) -> list:
    rows = _seq(rows, limits["requests"], "the waiting list")
    seen = set()
    for r in rows:
        r = _seq(r, 4, "a candidate")
        if len(r) != 4 or not (_is_int(r[0]) and _is_int(r[2]) and _is_int(r[3])) or r[0] in seen \
                or not 0 <= r[0] < limits["requests"] or r[3] < 0:
            raise MalformedSuspect("a candidate is not (seq_id, uid, blocks_needed, waited) of this case")
        _check_uid(r[1], limits, "a candidate's uid")
        seen.add(r[0])
    return rows


def _check_inputs(exercise_id: str, data: Any, limits: dict) -> None:
    """Raises :class:`MalformedSuspect` unless ``data`` is a call the engine of ``limits`` can make
    (``_args_data``'s shapes, exact types)."""
    if exercise_id == "ch11.1":
        data = _seq(data, 3, "block_hashes' inputs")
        if len(data) != 3:
            raise MalformedSuspect("block_hashes' inputs are not 3 values")
        tokens, uid, size = data
        tokens = _seq(tokens, limits["tokens"], "token_ids")
        if not all(_is_int(t) for t in tokens) or not _is_int(size) or size != limits["block_size"]:
            raise MalformedSuspect("block_hashes' inputs are not this case's tokens and block size")
        _check_uid(uid, limits, "adapter_id")
        return
    if exercise_id == "ch11.2":
        data = _seq(data, 8, "admit_requests' inputs")
        if len(data) != 8:
            raise MalformedSuspect("admit_requests' inputs are not 8 values")
        rows, running, resident, cap, free, max_new, draining, active = data
        _check_rows(rows, limits)
        for u in _seq(running, limits["requests"], "running_uids"):
            _check_uid(u, limits, "a running uid")
        resident = _seq(resident, len(limits["uids"]), "resident_uids")
        for u in resident:
            _check_uid(u, limits, "a resident uid")
        if len(set(resident)) != len(resident) or cap != limits["cap"] or not _is_int(cap) or not _is_int(free) \
                or not 0 <= free <= limits["kv_blocks"] or not _is_int(max_new) or max_new > limits["max_seqs"] \
                or type(active) is not bool:
            raise MalformedSuspect("admit_requests' limits are not this case's")
        _check_uid(draining, limits, "draining")
        return
    data = _seq(data, 4, "choose_drain's inputs")
    if len(data) != 4:
        raise MalformedSuspect("choose_drain's inputs are not 4 values")
    rows, pairs, cap, threshold = data
    _check_rows(rows, limits)
    pairs = _seq(pairs, len(limits["uids"]), "running_remaining")
    for pair in pairs:
        pair = _seq(pair, 2, "a running_remaining entry")
        if len(pair) != 2 or not _is_int(pair[1]):
            raise MalformedSuspect("a running_remaining entry is not (uid, tokens left)")
        _check_uid(pair[0], limits, "a running uid")
    if len({p[0] for p in pairs}) != len(pairs) or cap != limits["cap"] or not _is_int(cap) \
            or threshold is None or threshold != limits["threshold"] or not _is_int(threshold):
        raise MalformedSuspect("choose_drain's limits are not this case's")


def _result_items(value: Any, most: int) -> Optional[int]:
    """How many items the plain-data ``value`` holds (strings count a 64th of their length), or None
    past ``most`` (counted without recursion, stopping there); raises on what ``_as_data`` never gives."""
    count, stack = 0, [value]
    while stack:
        v = stack.pop()
        count += 1
        if type(v) in (list, tuple):
            stack.extend(v)
        elif type(v) is str:
            count += len(v) // 64
        elif not (v is None or type(v) in (bool, int, float)):
            raise MalformedSuspect(f"a recorded result holds a {type(v).__name__}")
        if count > most:
            return None
    return count


def _checked_suspects(case: Case, suspects: Any) -> list:
    """The child's suspects record as ``(exercise id, step, inputs, result)`` tuples, each one a call
    that this case's engine could have made (at most one per needed piece), in step order.

    Raises:
        MalformedSuspect: anything else (the driver never records it; the answer replaced it).
    """
    suspects = _seq(suspects, len(PIECES), "the suspects record")
    if not suspects:
        return []
    limits = _case_limits(case.args[0])
    checked = []
    for s in suspects:
        s = _seq(s, 4, "a suspect")
        if len(s) != 4:
            raise MalformedSuspect("a suspect is not (exercise id, step, inputs, result)")
        exercise_id, step, data, got = s
        if type(exercise_id) is not str or exercise_id not in PIECES or any(c[0] == exercise_id for c in checked):
            raise MalformedSuspect("a suspect names no needed piece, or one twice")
        if not _is_int(step) or not 0 <= step <= limits["steps"]:
            raise MalformedSuspect("a suspect's step is not a step of this case's run")
        _check_inputs(exercise_id, data, limits)
        _result_items(got, MAX_HINTED_RESULT_ITEMS)  # only its kinds here: a long result is not malformed
        checked.append((exercise_id, step, list(data), got))
    return sorted(checked, key=lambda s: s[1])


def _valid_suspects(case: Case, suspects: Any) -> list:
    """The recorded suspects that the reference, here, confirms: the learner's policy gave another
    result than the contract on those very inputs. Only a record :func:`_checked_suspects` accepts
    is replayed (a malformed one fails the case in compare_run); a result past
    MAX_HINTED_RESULT_ITEMS is not."""
    valid = []
    for exercise_id, step, data, got in _checked_suspects(case, suspects):
        if _result_items(got, MAX_HINTED_RESULT_ITEMS) is None:
            continue
        want = _piece_reference(exercise_id, data)
        # the engine never passes inputs the contract refuses: a call the reference refuses is junk
        if want[:1] != ["raises"] and _differs(exercise_id, got, want):
            valid.append((exercise_id, step, data, got))
    return valid


def _suspect_hint(suspect: tuple) -> str:
    exercise_id, step, data, got = suspect
    case = _piece_case(exercise_id, data)
    want = _piece_reference(exercise_id, data)
    own = {"ch11.1": _hash_hint, "ch11.2": _admit_hint, "ch11.3": _drain_hint}[exercise_id]
    try:
        named = own(case, want, got)
    except Exception:  # noqa: BLE001 (a hint is a courtesy)
        named = None
    name = PIECES[exercise_id]
    return (f"at step {step} the engine called your {name} ({exercise_id}) with {case.describe}: it returned "
            f"{got}, the contract gives {want}" + (f"; {named}" if named else "")
            + f". graders.check(\"{exercise_id}\", {name}) tests it on its own")


def _step_variant(**wrong) -> Callable:
    """The reference step with one named mistake (for hints; never graded)."""
    from reference.engine.model_runner import SeqWork

    def step(scheduler, runner):
        kind, work = scheduler.schedule()
        if not work:
            return kind
        batch = [SeqWork(w.seq.tokens if wrong.get("whole") else w.seq.tokens[w.start:w.end],
                         0 if wrong.get("start0") else w.start, list(w.seq.block_table), w.seq.uid) for w in work]
        running = ([] if wrong.get("no_running") else [w.seq.uid for w in work] if wrong.get("batch_running")
                   else [s.uid for s in scheduler.running])
        logits = runner.forward(batch, running=running)
        tokens = {}
        for i, w in enumerate(work):
            if (kind == "decode") if wrong.get("decode_only") else (w.end == w.seq.num_tokens):
                row = logits[-1] if wrong.get("last_row") else logits[i]
                tokens[i if wrong.get("row_keys") else w.seq.seq_id] = int(row.argmax())
        scheduler.postprocess(work, tokens)
        return kind
    return step


_RUNNING = ("runner.forward's running argument names the adapters in use: every RUNNING sequence's (the "
            "scheduler's running list), not only this step's batch's: in a prefill step the decoding sequences "
            "compute nothing, and their adapters must stay resident (the pool may evict an adapter it is not told "
            "is in use)")
_STEP_MISTAKES = [
    (dict(start0=True), "a SeqWork's start is w.start, the position of its first token: a later chunk, a decode "
                        "and a recomputed sequence do not start at 0 (rotary positions and KV slots come from it)"),
    (dict(whole=True), "compute only w.seq.tokens[w.start:w.end]: the tokens before w.start have their KV in the "
                       "cache already (an earlier chunk, a prefix hit, earlier decodes)"),
    (dict(batch_running=True), _RUNNING),
    (dict(no_running=True), _RUNNING),
    (dict(decode_only=True), "a prefill chunk that reaches its sequence's end gives that sequence's first token: "
                             "pick a token for every row with w.end == w.seq.num_tokens, in prefill steps too"),
    (dict(row_keys=True), "key next_tokens by w.seq.seq_id (postprocess looks each finished row's token up by its "
                          "sequence's id), not by the row's index"),
    (dict(last_row=True), "row i of the logits belongs to work[i]: pick each sequence's token from its own row"),
]


def _strip_where(line: str) -> str:
    return line.split(" -- ")[0]


def _same_run(a: tuple, b: Any) -> bool:
    """Equal logs (an error line compared without where it was raised) and tokens."""
    return ([_strip_where(x) for x in a[0]] == [_strip_where(x) for x in b[0]]
            and [list(t) for t in a[1]] == [list(t) for t in b[1]])


def _same_but_computed(a: str, b: str) -> bool:
    """Two log lines that differ only in what runner.forward computed."""
    strip = lambda x: re.sub(r"; computed: [^;]* tokens;", ";", x)  # noqa: E731
    return strip(a) == strip(b)


def _step_hint(case: Case, expected: tuple, got: tuple) -> Optional[str]:
    d = first_difference(expected[0], list(got[0]))
    line = got[0][d] if d is not None and d < len(got[0]) else ""
    last = got[0][-1] if got[0] else ""
    if d == 0 and line.startswith("step 0"):
        return ("return the step's kind: with nothing to run, scheduler.schedule() returns ('idle', []); return "
                "'idle' at once, without calling runner.forward (there is no work to compute)")
    if "(returned " in line:
        return ("return the step's kind: the first value scheduler.schedule() returned ('prefill', 'decode', "
                "'mixed' or 'idle'; the engine counts its steps by it)")
    if last.startswith("error") and "KeyError" in last and "(postprocess)" in last:
        return ("postprocess looks up next_tokens[w.seq.seq_id] for every row with w.end == w.seq.num_tokens: "
                "key next_tokens by w.seq.seq_id (not the sequence's uid, not the row's index) and give every such "
                "row its token, in prefill steps too")
    if last.startswith("error") and "short of its end gives no token" in last:
        return ("pick a token only for the items with w.end == w.seq.num_tokens: a prefill chunk short of its "
                "sequence's end has no next token (its last row's logits predict a token the prompt already has)")
    if last.startswith("error") and "changed nothing" in last:
        return ("end the step with scheduler.postprocess(work, next_tokens): it records the computed KV and the "
                "new tokens; without it the scheduler hands out the same work again")
    for flags, message in _STEP_MISTAKES:
        variant = drive_engine(_step_variant(**flags), dict(_REFERENCE_POLICIES), case.args[0])
        if _same_run(variant, got) and not _same_run(variant, expected):
            return message
    want = expected[0][d] if d is not None and d < len(expected[0]) else ""
    counts = [re.search(r"; computed: ([^;]*) tokens;", x) for x in (want, line)]
    if all(counts) and counts[0].group(1) != counts[1].group(1) and _same_but_computed(want, line):
        return (f"this step's runner.forward computed {counts[1].group(1)} tokens where the step scheduled "
                f"{counts[0].group(1)}: give the runner exactly the scheduled tokens, one SeqWork("
                "w.seq.tokens[w.start:w.end], w.start, ...) per work item in one call (the tokens before w.start "
                "have their KV in the cache already)")
    if "(decode)" in want and "(prefill)" in line:
        return ("the scheduler still hands out prefill work where the reference decodes: an earlier step's computed "
                "tokens were not recorded as the scheduler expects (scheduler.postprocess(work, next_tokens) records "
                "the KV computed, the new tokens and each sequence's state)")
    return None


def capstone_hint(case: Case, expected: tuple, got: Any) -> Optional[str]:
    """Name what went wrong: the first of the learner's policies that gave another result than the
    contract at or before the step where the logs first differ (re-checked here), else a known
    mistake of the step (the reference step with that mistake gives the same run), else nothing."""
    if not _well_formed(got):
        return None
    d = first_difference(expected[0], list(got[0]))
    last = (d + 1) if d is not None else len(got[0])
    suspects = [s for s in _valid_suspects(case, got[2]) if s[1] <= last]
    if suspects:  # the piece the engine's error points at first, then by step
        error = got[0][-1] if got[0] and got[0][-1].startswith("error") else ""
        blamed = next((ex for where, ex in _WHERE if where in error), None)
        suspects.sort(key=lambda s: (s[0] != blamed, s[1]))
        return "\n".join(_suspect_hint(s) for s in suspects)
    return _step_hint(case, expected, got)


#: Where in the engine an error points at a policy's result: (text of the error line, exercise).
_WHERE = (("(_admit)", "ch11.2"), ("block_manager.py", "ch11.1"), ("(_update_drain)", "ch11.3"))


# ---------------------------------------------------------------------------------------------
# Cases: one family per clause; the random and hidden groups draw every family again

_NAMES = ("sql", "chat", "code", "math", "law", "med", "fin", "bio", "tutor", "poet")
_ENGINE = dict(max_loras_per_batch=2, max_lora_rank=16, max_loaded_loras=None, num_kv_blocks=32, block_size=4,
               max_num_seqs=4, max_num_batched_tokens=16, drain_threshold=None, eviction_policy="lru",
               backend="torch")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(MODEL_CONFIG["vocab_size"]) for _ in range(n)]


def _engine_config(**changes) -> dict:
    return {**_ENGINE, **changes}


def _base_alone(rng: random.Random, tag: str) -> Case:
    return workload_case(f"{tag}_one_base_request", {}, _engine_config(),
                         [(_tokens(rng, rng.randint(5, 7)), None, 3, [])])


def _chunked(rng: random.Random, tag: str, names: list) -> Case:
    """A base request, a short request and a prompt longer than the budget of 8: the long one is
    prefilled in chunks beside the others' steps (its logits count only at its end), while the base
    request decodes."""
    a = names[0]
    kind = rng.choice(sorted(ADAPTER_KINDS))
    # a base request first: it decodes while the long prompt's chunks are prefilled, so the base
    # model must stay among the running uids of those prefill steps
    short, long_, last = _tokens(rng, rng.randint(4, 6)), _tokens(rng, rng.randint(17, 23)), _tokens(rng, 3)
    # (the base request's tokens come from the others': no draw of its own, so every later family's
    # draws stay what they were)
    reqs = [(last[::-1], None, 6, []), (short, a, 6, []), (long_, a, 3, []), (last, None, 4, [])]
    return workload_case(f"{tag}_chunked_prompt_beside_decodes", {a: kind},
                         _engine_config(max_num_batched_tokens=8), reqs)


def _cross_adapter_prefix(rng: random.Random, tag: str, names: list) -> Case:
    """One prompt under two adapters that both change K and V, one request at a time: the second
    adapter must find none of the first's blocks; the first adapter's second request finds its own."""
    a, b = names[:2]
    ka, kb = rng.sample(KV_KINDS, 2)
    prompt = _tokens(rng, 4 * rng.randint(3, 4) + 1)
    reqs = [(prompt, a, 4, []), (prompt, b, 4, []), (prompt + _tokens(rng, 2), a, 3, [])]
    return workload_case(f"{tag}_one_prompt_under_two_adapters", {a: ka, b: kb}, _engine_config(max_num_seqs=1), reqs)


def _repeated_blocks(rng: random.Random, tag: str, names: list) -> Case:
    """Equal blocks after different prefixes (request 1 starts with request 0's second block) and a
    prompt of two equal blocks asked twice: only chained keys keep them apart."""
    a = names[0]
    first, second, third = _tokens(rng, 4), _tokens(rng, 4), _tokens(rng, 4)
    same = [rng.randrange(MODEL_CONFIG["vocab_size"])] * 8
    tail = _tokens(rng, 2)
    reqs = [(first + second + tail[:1], a, 3, []), (second + third + tail, a, 3, []), (same + tail[:1], a, 3, []),
            (same + tail[1:], a, 3, [])]
    return workload_case(f"{tag}_equal_blocks_after_different_prefixes", {a: rng.choice(KV_KINDS)},
                         _engine_config(max_num_seqs=1), reqs)


def _slots(rng: random.Random, tag: str, names: list) -> Case:
    """Four adapters and the base model through 2 GPU slots and a CPU tier of 1: the cap (the base
    counted), warm-first admission, evictions from both tiers, and a long decode of one adapter
    while others are prefilled beside it (its adapter must stay resident)."""
    w, x, y, z = names[:4]
    kinds = rng.sample(sorted(ADAPTER_KINDS), 4)
    reqs = [(_tokens(rng, 5), x, 9, []), (_tokens(rng, 6), w, 1, []), (_tokens(rng, 4), y, 2, []),
            (_tokens(rng, 5), None, 2, []), (_tokens(rng, 3), z, 2, []), (_tokens(rng, 4), w, 2, []),
            (_tokens(rng, 6), x, 2, []), (_tokens(rng, 3), None, 2, [])]
    return workload_case(f"{tag}_more_adapters_than_slots", dict(zip((w, x, y, z), kinds)),
                         _engine_config(max_loaded_loras=2), reqs)


def _preemption(rng: random.Random, tag: str, names: list) -> Case:
    """A KV cache of 9 blocks of 4 for requests that grow past it: recompute preemption, and a
    17-token prompt (5 blocks) that does not fit stopping admission, the small request behind it
    waiting too."""
    a, b = names[:2]
    reqs = [(_tokens(rng, rng.randint(9, 11)), a, 10, []), (_tokens(rng, rng.randint(7, 9)), None, 10, []),
            (_tokens(rng, rng.randint(6, 8)), b, 7, []), (_tokens(rng, 17), a, 3, []),
            (_tokens(rng, rng.randint(2, 4)), a, 2, [])]
    return workload_case(f"{tag}_small_kv_cache_preempts", {a: rng.choice(sorted(ADAPTER_KINDS)),
                                                            b: rng.choice(sorted(ADAPTER_KINDS))},
                         _engine_config(num_kv_blocks=9, max_num_batched_tokens=32), reqs)


def _drain(rng: random.Random, tag: str, names: list) -> Case:
    """Cap 2: a long request of one adapter, a queue of short requests of a hot one, a rare one behind
    them; with a threshold of 2 steps the hot adapter is drained for the rare one."""
    hot, long_, rare = names[:3]
    kinds = rng.sample(sorted(ADAPTER_KINDS), 3)
    reqs = ([(_tokens(rng, 4), long_, 12, [])] + [(_tokens(rng, rng.randint(3, 5)), hot, rng.randint(2, 3), [])
                                                   for _ in range(5)] + [(_tokens(rng, 4), rare, 2, [])])
    return workload_case(f"{tag}_starving_adapter_drained", dict(zip((hot, long_, rare), kinds)),
                         _engine_config(max_num_seqs=3, drain_threshold=2), reqs)


def _mixed(rng: random.Random, tag: str, names: list) -> Case:
    """A free draw: 3 or 4 adapters and the base model, system prompts shared within an adapter and
    across adapters, stop tokens, a tight KV cache, a small budget, sometimes a drain."""
    adapters = {n: rng.choice(sorted(ADAPTER_KINDS)) for n in names[:rng.randint(3, 4)]}
    system = {n: _tokens(rng, rng.choice([4, 5, 8])) for n in [*adapters, None]}
    shared = _tokens(rng, 4)
    reqs = []
    for _ in range(rng.randint(7, 9)):
        a = rng.choice([*adapters, None])
        head = shared if rng.random() < 0.3 else system[a]
        reqs.append((head + _tokens(rng, rng.randint(1, 6)), a, rng.randint(2, 5),
                     _tokens(rng, 6) if rng.random() < 0.3 else []))
    engine = _engine_config(max_loras_per_batch=rng.choice([2, 3]), max_loaded_loras=None,
                            num_kv_blocks=rng.randint(10, 14), max_num_batched_tokens=rng.choice([8, 12, 16]),
                            max_num_seqs=rng.randint(3, 5), drain_threshold=rng.choice([None, 2, 4]))
    return workload_case(f"{tag}_mixed", adapters, engine, reqs)


def _tied_logits(rng: random.Random, tag: str, names: list) -> Case:
    """An adapter's and a base request on a model whose next-token logits tie in pairs: greedy picks
    the lower id of each tie."""
    a = names[0]
    reqs = [(_tokens(rng, rng.randint(4, 6)), a, 4, []), (_tokens(rng, rng.randint(3, 5)), None, 4, [])]
    return workload_case(f"{tag}_tied_logits_go_to_the_lower_id", {a: rng.choice(sorted(ADAPTER_KINDS))},
                         _engine_config(), reqs, tied=True)


_FAMILIES = (_chunked, _cross_adapter_prefix, _repeated_blocks, _slots, _preemption, _drain)


def _edge() -> list[Case]:
    rng = random.Random(11)
    return ([_base_alone(rng, "edge")] + [family(rng, "edge", list(_NAMES)) for family in _FAMILIES]
            + [_tied_logits(rng, "edge", list(_NAMES))])


def _random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for family in _FAMILIES + (_mixed, _tied_logits):  # the later families last: earlier draws unchanged
        cases.append(family(rng, "random", rng.sample(_NAMES, 4)))
    return cases


def _reference_engine_step():
    from reference.engine.llm import engine_step

    return engine_step


def _drive_reference(workload: dict) -> tuple:
    """The expected run: the reference step and the reference policies."""
    return drive_engine(_reference_engine_step(), dict(_REFERENCE_POLICIES), workload)


EXERCISES = [
    Exercise("ch11.5", "engine_step", ("workload",), _drive_reference, _edge, _random, capstone_hint,
             driver=drive_engine, fresh_result=False, grade_on="cpu", needs=tuple(PIECES), compare=compare_run,
             child_imports=("transformers.models.llama.modeling_llama", "reference.engine.llm")),
]
