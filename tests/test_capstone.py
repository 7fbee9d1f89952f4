"""Chapter 11's capstone grader (ch11.5, graders/chapters/ch11_capstone.py): its expected runs are PEFT's own
greedy generate of each request alone, its cases exercise every mechanism they are named for, a
broken or missing needed answer (ch11.1-ch11.3) costs only what the judge finds and is named in the
report, and both ways of grading (the learner's kernel with ``uses=``, the trusted re-grade through
``graders.machine.needs.with_needed``) assemble the same answer bundle and give the same score.
"""
from __future__ import annotations

import copy
import random
import re
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

import graders
from graders.chapters import ch11_capstone as cap
from graders.course.mutation import graded_source, solution_answers
from graders.machine.core import _build_cases, grade_many_under_secrets, grade_source
from graders.machine.exercise import Case
from graders.machine.needs import bundle, split_bundle, with_needed
from graders.machine.registry import EXERCISES

peft = pytest.importorskip("peft")

SOLUTIONS = solution_answers()
#: The public draws and two instructors' hidden draws.
SECRETS = ("capstone-secret-a", "capstone-secret-b")
NEEDS = ("ch11.1", "ch11.2", "ch11.3")


def _cases() -> list:
    return _build_cases(EXERCISES["ch11.5"], list(SECRETS))


@pytest.fixture(scope="module")
def cases_and_runs():
    cases = _cases()
    return [(c, cap._drive_reference(c.args[0])) for c in cases]


@pytest.fixture(scope="module")
def peft_model():
    """Every adapter kind over the cases' base model (seed 0), loaded into one PeftModel by kind: a
    case's adapter names are labels of these kinds (same files, see cap.peft_files)."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from safetensors.torch import save_file

        kinds = sorted(cap.ADAPTER_KINDS)
        for kind in kinds:
            files = cap.peft_files(0, kind)
            (Path(tmp) / kind).mkdir()
            (Path(tmp) / kind / "adapter_config.json").write_text(files["config_json"])
            save_file(dict(files["weights"]), str(Path(tmp) / kind / "adapter_model.safetensors"))
        base = cap._tiny_llama(cap.base_weights(0))
        model = peft.PeftModel.from_pretrained(copy.deepcopy(base), Path(tmp) / kinds[0], adapter_name=kinds[0])
        for kind in kinds[1:]:
            model.load_adapter(Path(tmp) / kind, adapter_name=kind)
    return model.eval()


def _peft_greedy(model, prompt, kind, max_new_tokens, stops) -> list[int]:
    ids = torch.tensor([prompt])
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind is None:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, **kw)
        else:
            model.set_adapter(kind)
            out = model.generate(input_ids=ids, **kw)
    tokens = out[0, len(prompt):].tolist()
    cut = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokens[:cut]


def _use_lm_head(model, workload: dict) -> None:
    """The workload's lm_head in the PEFT model: the tied-logits cases change only lm_head
    (cap.tied_weights), which no adapter targets."""
    with torch.no_grad():
        model.get_output_embeddings().weight.copy_(workload["model"]["weights"]["lm_head.weight"])


def test_every_expected_run_is_pefts_generate_of_each_request_alone(cases_and_runs, peft_model):
    """The judge's expected tokens (the reference engine's, computed in the comparer) are PEFT's, on
    the edge and public random cases and on the hidden cases of two secrets."""
    checked = 0
    for case, (log, tokens, suspects) in cases_and_runs:
        workload = case.args[0]
        assert not log[-1].startswith("error"), (case.name, log[-1])
        assert suspects == [], (case.name, suspects)
        _use_lm_head(peft_model, workload)
        for i, (prompt, name, n, stops) in enumerate(workload["requests"]):
            kind = None if name is None else workload["adapters"][name]["kind"]
            want = _peft_greedy(peft_model, prompt, kind, n, stops)
            assert tokens[i] == want, f"{case.name} request {i} ({name}, {kind}): {tokens[i]} != PEFT {want}"
            checked += 1
    assert checked >= 100


def test_the_adapters_change_the_tokens(cases_and_runs, peft_model):
    """An engine that ignored every adapter would fail: many requests differ from the base model's."""
    differ = total = 0
    for case, (_, tokens, _) in cases_and_runs:
        _use_lm_head(peft_model, case.args[0])
        for i, (prompt, name, n, stops) in enumerate(case.args[0]["requests"]):
            if name is not None:
                total += 1
                differ += tokens[i] != _peft_greedy(peft_model, prompt, None, n, stops)
    assert differ >= total // 2, (differ, total)


def _steps(log: list[str], pattern: str) -> list:
    return [m for line in log for m in re.findall(pattern, line)]


def _kept_beside(case, line: str) -> bool:
    """Whether the pool part of a prefill step's log line holds an adapter none of the step's
    sequences uses."""
    requests = case.args[0]["requests"]
    batch = {requests[int(k)][1] or "base" for k in re.findall(r"prefill #(\d+)", line)}
    pool = line.split("; pool: ")[1]
    kept = {u.split("@")[0] for u in re.findall(r"(\S+) in slot \d", pool)}
    return bool(kept - batch)


def test_each_case_exercises_the_mechanism_it_is_named_for(cases_and_runs):
    for case, run in cases_and_runs:
        log = run[0]
        text = "\n".join(log)
        name = case.name
        # a prefill chunk that continues a prompt (no admission of that sequence in its step)
        chunks = [line for line in log for seq, start in re.findall(r"prefill #(\d+) \[(\d+):", line)
                  if int(start) > 0 and f"admit #{seq}," not in line]
        hits = [(s, int(start)) for s, start in re.findall(r"admit #(\d+), prefill #\d+ \[(\d+):", text) if int(start)]
        if name.endswith("chunked_prompt_beside_decodes"):
            assert len(chunks) >= 2 and "decode" in text, (name, log)
        elif name.endswith("one_prompt_under_two_adapters"):
            assert {a["kind"] for a in case.args[0]["adapters"].values()} <= set(cap.KV_KINDS)
            # the other adapter's request (#1) finds nothing, the same adapter's second (#2) its blocks
            assert [s for s, _ in hits] == ["2"], (name, log)
        elif name.endswith("equal_blocks_after_different_prefixes"):
            assert [s for s, _ in hits] == ["3"], (name, log)
        elif name.endswith("more_adapters_than_slots"):
            assert "evict" in text and "drop the CPU copy" in text, (name, log)
            assert len(case.args[0]["adapters"]) > case.args[0]["engine"]["max_loras_per_batch"]
            # a prefill step that keeps an adapter resident which none of its own sequences uses: the
            # adapter of a sequence decoding beside it (engine_step's `running`)
            assert any(_kept_beside(case, line) for line in log if "(prefill)" in line), (name, log)
        elif name.endswith("small_kv_cache_preempts"):
            assert "preempt #" in text, (name, log)
            first = log[1]  # log[0] is step 0, the idle probe
            assert "admit #3" not in first and "admit #4" not in first, (name, first)  # KV stopped admission
        elif name.endswith("starving_adapter_drained"):
            assert "drain " in text and "ends" in text, (name, log)
        elif name.endswith("one_base_request"):
            assert len(log) == 4 and log[0].startswith("step 0, before any request"), log  # the idle probe
        elif name.endswith("tied_logits_go_to_the_lower_id"):
            _, tokens, _ = run
            assert all(t % 2 == 0 for seq in tokens for t in seq), (name, tokens)  # every pick is a tie's lower id
    families = {c.name.split("_", 1)[1] for c, _ in cases_and_runs}
    assert len(families) == 9, families


def _bundle_with(**cells) -> str:
    """The solution bundle of ch11.5 with some cells replaced (``ch11_2=...``), or left out (None)."""
    parts = {ex: SOLUTIONS[ex] for ex in NEEDS}
    own = cells.pop("ch11_5", SOLUTIONS["ch11.5"])
    for key, source in cells.items():
        ex = key.replace("_", ".")
        if source is None:
            parts.pop(ex)
        else:
            parts[ex] = source
    return bundle("ch11.5", own, parts)


BROKEN = [
    (dict(ch11_2="def admit_requests(*args):\n    raise RuntimeError('boom')\n"),
     "your admit_requests (ch11.2) raised RuntimeError: boom -- answer cell ch11.2 line 2"),
    (dict(ch11_1=None), "your ch11.1 block_hashes: no answer cell of ch11.1 was given to the grader"),
    (dict(ch11_3="from reference.mem_pool import uid_sort_key\nundefined_name\n"),
     "running your ch11.3 answer cell failed: NameError"),
    (dict(ch11_1="def block_hashes(token_ids, adapter_id, block_size):\n    # YOUR CODE HERE\n"
                 "    raise NotImplementedError()\n"),
     "your block_hashes (ch11.1) raised NotImplementedError"),
    (dict(ch11_3="def something_else():\n    pass\n"), "the answer cell defines nothing named 'choose_drain'"),
    (dict(ch11_5="def engine_step(scheduler, runner):\n    import os\n    os._exit(3)\n"), "the process ended"),
    # a top-level endless loop in a needed cell: named under its id after NEEDED_CELL_SECONDS
    (dict(ch11_3="while True:\n    pass\n"), "running your ch11.3 answer cell did not finish within 10 s"),
]


@pytest.fixture(scope="module")
def broken_results():
    sources = [_bundle_with(**dict(cells)) for cells, _ in BROKEN]
    return grade_many_under_secrets("ch11.5", sources, ["broken-secret"])


@pytest.mark.parametrize("index", range(len(BROKEN)), ids=[b[1][:40] for b in BROKEN])
def test_a_broken_or_missing_needed_answer_is_named_and_costs_only_the_capstone(broken_results, index):
    result = broken_results[index]["broken-secret"]
    assert result.score == 0.0, result.report
    assert BROKEN[index][1] in result.report, result.report


def test_a_raising_piece_names_its_inputs_and_the_step():
    source = _bundle_with(ch11_2=SOLUTIONS["ch11.2"].replace(
        "    for c in order:\n", "    if drain_active:\n        raise ValueError('no drains here')\n    for c in order:\n"))
    report = grade_source("ch11.5", source).report
    assert "your admit_requests (ch11.2) raised ValueError: no drains here" in report, report
    assert "drain_active True" in report and re.search(r"error at step \d+", report), report


def test_a_mismatch_report_says_which_token_and_which_field_of_a_step_first_differ():
    """Issue #33: the report names the generated token and the log field that first differ, not only
    two token lists and two whole log lines."""
    case = Case("synthetic", [{"requests": [([5, 6, 7], None, 3, None)]}], "")
    first = "step 1 (prefill): admit #0, prefill #0 [0:3); computed: 3 tokens; pool: load base into slot 0 from base"
    expected = ([first, "step 2 (decode): decode #0; computed: 1 tokens; pool: base in slot 0"], [[93, 58, 47]], [])
    got = ([first, "step 2 (decode): decode #0; computed: 4 tokens; pool: base in slot 0"], [[93, 106, 56]], [])
    report = cap.compare_run(case, expected, got)
    assert "its generated token 1 (of 3) first differs, expected 58, got 106" in report, report
    assert "the logs first differ at step 1, in the token counts runner.forward computed (expected '1', got '4')" in report
    got = ([first, "step 2 (prefill): prefill #0 [0:3); computed: 3 tokens; pool: base in slot 0"], [[93]], [])
    report = cap.compare_run(case, expected, got)
    assert "it stopped after 1 of its 3 tokens" in report and "in the step's kind (expected 'decode', got 'prefill')" in report


def test_the_kernel_path_finds_the_needed_cells_through_uses(tmp_path, capsys):
    """In a notebook the cells share one namespace; check takes each function's cell as its source."""
    namespace: dict = {}
    for ex in (*NEEDS, "ch11.5"):
        cell = tmp_path / f"cell_{ex.replace('.', '_')}.py"
        source = SOLUTIONS[ex]
        if ex == "ch11.2":  # a learner who named it otherwise: check adds an alias for the grader
            source = source.replace("def admit_requests(", "def my_admission(")
        cell.write_text(source)
        exec(compile(source, str(cell), "exec"), namespace)
    score = graders.check("ch11.5", namespace["engine_step"],
                          uses=(namespace["block_hashes"], namespace["my_admission"], namespace["choose_drain"]))
    out = capsys.readouterr()
    assert score == 3.0 and out.err == "", out.out
    # uses missing, of the wrong length, or not functions: a message, no grading
    assert graders.check("ch11.5", namespace["engine_step"]) == 0.0
    assert "uses=(block_hashes, admit_requests, choose_drain)" in capsys.readouterr().out
    assert graders.check("ch11.5", namespace["engine_step"], uses=(namespace["block_hashes"], None, 3)) == 0.0
    assert "expected your ch11.2 function admit_requests, got NoneType" in capsys.readouterr().out
    assert graders.check("ch11.1", namespace["block_hashes"], uses=(namespace["choose_drain"],)) == 0.0
    assert "runs only its own answer" in capsys.readouterr().out


def test_the_trusted_regrade_line_bundles_the_same_notebooks_cells():
    """trusted_regrade grades every answer cell as a job (student, notebook, exercise, cell source);
    ``grade_source(job[2], with_needed(job, jobs))`` gives the capstone its needed cells from the same
    student's notebook, and leaves every other exercise's source as it is."""
    jobs = [("alice", "11_serving_engine", ex, SOLUTIONS[ex]) for ex in (*NEEDS, "ch11.4", "ch11.5")]
    kv = "        if c.blocks_needed > free_blocks:\n            break\n"
    broken = SOLUTIONS["ch11.2"].replace(kv, kv.replace("break", "continue"))  # a KV shortfall skipped
    assert broken != SOLUTIONS["ch11.2"]
    jobs += [("bob", "11_serving_engine", ex, broken if ex == "ch11.2" else SOLUTIONS[ex]) for ex in (*NEEDS, "ch11.5")]
    assert with_needed(jobs[3], jobs) == SOLUTIONS["ch11.4"]
    alice, bob = with_needed(jobs[4], jobs), with_needed(jobs[-1], jobs)
    assert alice == graded_source("ch11.5", SOLUTIONS)
    own, needed = split_bundle("ch11.5", bob)
    assert _trimmed(own) == _trimmed(SOLUTIONS["ch11.5"])
    assert {ex: _trimmed(src) for ex, src in needed.items()} == {
        "ch11.1": _trimmed(SOLUTIONS["ch11.1"]), "ch11.2": _trimmed(broken), "ch11.3": _trimmed(SOLUTIONS["ch11.3"])}
    results = grade_many_under_secrets("ch11.5", [alice, bob], ["regrade-secret"])
    assert results[0]["regrade-secret"].score == 3.0, results[0]["regrade-secret"].report
    assert results[1]["regrade-secret"].score < 3.0
    assert "your admit_requests (ch11.2)" in results[1]["regrade-secret"].report


def _trimmed(source: str) -> str:
    """A cell without its trailing blank lines (a bundle keeps one newline at the end of each cell)."""
    return source.rstrip("\n")


def test_a_bundle_round_trips_and_text_without_markers_is_the_own_cell():
    own, needed = split_bundle("ch11.5", graded_source("ch11.5", SOLUTIONS))
    assert _trimmed(own) == _trimmed(SOLUTIONS["ch11.5"])
    assert {ex: _trimmed(src) for ex, src in needed.items()} == {ex: _trimmed(SOLUTIONS[ex]) for ex in NEEDS}
    assert split_bundle("ch11.5", SOLUTIONS["ch11.5"]) == (SOLUTIONS["ch11.5"], {})
    # order follows the exercise's needs, whatever the mapping's order
    assert bundle("ch11.5", "x = 1\n", {"ch11.3": "c\n", "ch11.1": "a\n"}) == "# %% ch11.1\na\n# %% ch11.3\nc\n# %% ch11.5\nx = 1\n"


def test_drive_engine_reports_a_missing_piece_before_running_anything():
    from graders.machine.needs import PieceUnavailable

    case = _cases()[0]
    pieces = dict(cap._REFERENCE_POLICIES, **{"ch11.2": PieceUnavailable("ch11.2", "no answer cell")})
    log, tokens, suspects = cap.drive_engine(cap._reference_engine_step(), pieces, case.args[0])
    assert log == ["error before step 1: your ch11.2 admit_requests: no answer cell"]
    assert tokens == [[]] and suspects == []


def test_the_random_and_hidden_groups_draw_every_family_again():
    ex = EXERCISES["ch11.5"]
    public = ex.random_cases(random.Random(1), None, False)
    hidden = ex.random_cases(random.Random(2), None, True)
    assert [c.name for c in public] == [c.name for c in hidden]
    assert [c.args[0]["requests"] for c in public] != [c.args[0]["requests"] for c in hidden]


# ---------------------------------------------------------------------------------------------
# Red-team review 41, H3: the comparer replayed the reference on a suspects record of any size (the
# child's data), O(n^2), with no budget; now a record is checked against what the case's engine
# could have passed, and anything else fails the case as malformed before any replay.


def _suspect_of_size(n: int) -> list:
    """An admit_requests "suspect" of n waiting candidates and n running uids (a05's record): the
    reference's replay of it is O(n^2); no case of the capstone has more than 9 requests."""
    rows = [[i, -1 - i, 1, 0] for i in range(n)]
    return ["ch11.2", 1, [rows, list(range(n)), [], 1, 10**9, 10**9, None, False], [0]]


def _honest_suspect(case: Case) -> list:
    """A call the engine of ``case`` can make, with a result the reference does not give (admits nothing)."""
    uid = next(iter(case.args[0]["adapters"]), None)
    uid = None if uid is None else f"{uid}@0"
    rows = [[0, uid, 1, 0]]
    return ["ch11.2", 1, [rows, [], [], case.args[0]["engine"]["max_loras_per_batch"], 4, 2, None, False], []]


def _malformed_records(case: Case) -> dict:
    good = _honest_suspect(case)
    with_data = lambda k, v: [*good[:2], [*good[2][:k], v, *good[2][k + 1:]], good[3]]  # noqa: E731
    return {
        "oversized": [_suspect_of_size(2000)],
        "a uid of no adapter": [with_data(0, [[0, "nobody@7", 1, 0]])],
        "a seq_id past the requests": [with_data(0, [[50, None, 1, 0]])],
        "a bool for an int": [with_data(3, True)],
        "another cap": [with_data(3, 99)],
        "more free blocks than the cache": [with_data(4, 10**6)],
        "two suspects of one piece": [good, good],
        "more suspects than pieces": [good] * 4,
        "no piece": [["ch99.9", 1, good[2], []]],
        "a step past the run": [["ch11.2", 10**9, good[2], []]],
        "a float step": [["ch11.2", 1.0, good[2], []]],
        "a result holding a mapping": [[*good[:3], {"a": 1}]],
        "not a list": "suspects",
    }


def test_a_suspect_the_engine_could_not_have_passed_fails_the_case_as_malformed():
    case = _cases()[1]  # an edge case with an adapter
    expected = cap._drive_reference(case.args[0])
    for what, record in _malformed_records(case).items():
        with pytest.raises(cap.MalformedSuspect):  # even beside a right run: the machine's MALFORMED
            cap.compare_run(case, expected, (expected[0], expected[1], record))
        with pytest.raises(cap.MalformedSuspect):  # nothing replayed (the machine drops a hint that raises)
            cap.capstone_hint(case, expected, (expected[0][:1], expected[1], record))
    # a call the engine can make is replayed and named, as before
    got = (expected[0][:1], expected[1], [_honest_suspect(case)])
    assert cap.compare_run(case, expected, got)
    assert "your admit_requests (ch11.2)" in cap.capstone_hint(case, expected, got)
    # a long result is what a policy may return: not malformed, only not hinted (a bounded courtesy)
    long_result = (expected[0][:1], expected[1], [[*_honest_suspect(case)[:3], list(range(5000))]])
    assert cap.compare_run(case, expected, long_result)
    assert "your admit_requests" not in (cap.capstone_hint(case, expected, long_result) or "")


def test_an_oversized_record_costs_the_comparer_no_more_than_an_honest_one():
    case = _cases()[0]
    expected = cap._drive_reference(case.args[0])
    big = (expected[0][:1], expected[1], [_suspect_of_size(200_000)])  # replayed: about 10 minutes
    start = time.perf_counter()
    with pytest.raises(cap.MalformedSuspect):
        cap.compare_run(case, expected, big)
    with pytest.raises(cap.MalformedSuspect):
        cap.capstone_hint(case, expected, big)
    assert time.perf_counter() - start < 5.0


@pytest.mark.slow
def test_an_answer_that_returns_an_oversized_suspect_from_its_child_is_graded_in_bounded_time():
    """a05 through grade_source: the answer cell replaces the driver in its own child and returns a
    wrong run whose suspects record holds an admit_requests call of 200 000 candidates (before the
    fix the comparer replayed it for hours). Now: 0 points, the case reported as malformed, and the
    grade takes about what an honest one does (the child's budget is 40 s)."""
    attack = textwrap.dedent('''
        import graders.chapters.ch11_capstone as _cap
        _calls = []
        def _fake_driver(step_fn, pieces, workload):
            _calls.append(1)
            n = 200000 if len(_calls) == 1 else 1
            rows = [[i, -1 - i, 1, 0] for i in range(n)]
            data = [rows, list(range(n)), [], 1, 10**9, 10**9, None, False]
            return (["step 1 (prefill): nothing; computed: 0 tokens; pool: "], [[] for _ in workload["requests"]],
                    [["ch11.2", 1, data, [0]]])
        _cap.drive_engine = _fake_driver
    ''')
    start = time.perf_counter()
    result = grade_source("ch11.5", _bundle_with(ch11_5=attack + SOLUTIONS["ch11.5"]))
    elapsed = time.perf_counter() - start
    assert result.score == 0.0, result.report
    assert "could not read what your function's process returned" in result.report, result.report
    assert "MalformedSuspect" in result.report and "at most" in result.report, result.report
    assert elapsed < 120, (elapsed, result.report)
