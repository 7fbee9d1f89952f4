"""The decode schedule rule (reference/ops/decode_schedule.py, issue #35): its table is what the committed
H200 runs give (benchmarks/derive_decode_rule.py), every measured cell takes its measured schedule, a
step between cells takes the cell at or below it, and a batch's schedule reaches the ops."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from reference.cuda_graph import StaticLoRABatch
from reference.ops import bgmv_shrink, torch_ref
from reference.ops.bgmv_expand import choose_expand_schedule
from reference.ops import decode_schedule
from reference.ops.decode_schedule import (DECODE_SCHEDULES, MEASURED_H100, MEASURED_H200, NOISE_H100, NOISE_H200,
                                           choose_decode_schedule, device_key, device_table, reachable_schedules,
                                           schedule_parts)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import derive_decode_rule  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


TABLES = {"h200": (MEASURED_H200, NOISE_H200), "h100": (MEASURED_H100, NOISE_H100)}


@pytest.fixture(scope="module")
def derived():
    return derive_decode_rule.derive()


@pytest.fixture(scope="module", params=sorted(TABLES))
def derived_by_device(request):
    return request.param, derive_decode_rule.derive(device=request.param)


def test_the_rule_table_is_what_the_committed_runs_give(derived_by_device):
    """A new committed run that changes a cell's best schedule fails here until
    ``python benchmarks/derive_decode_rule.py [--device h100] --write`` regenerates the table."""
    device, derived = derived_by_device
    table, noise = TABLES[device]
    assert derived["table"] == table
    assert round(derived["noise"], 4) == noise
    text = derive_decode_rule.RULE_FILE.read_text()
    assert derive_decode_rule.current_block(text, device) == derive_decode_rule.render_block(derived, device)
    assert derived["cells"], "no committed decode-step run was read"


def test_every_measured_cell_takes_the_simplest_schedule_within_the_noise_of_the_best(derived_by_device):
    device, derived = derived_by_device
    table, noise = TABLES[device]
    for (rank, tokens, adapters), cell in derived["cells"].items():
        picked = choose_decode_schedule(tokens, adapters, rank, table=table)
        assert picked == cell["schedule"], (rank, tokens, adapters, picked, cell)
        deltas, best = cell["deltas"], min(cell["deltas"].values())
        assert deltas[picked] <= best + noise
        simpler = DECODE_SCHEDULES[:DECODE_SCHEDULES.index(picked)]
        assert all(deltas[s] > best + noise for s in simpler if s in deltas), (rank, tokens, adapters, deltas)


@pytest.mark.parametrize("name, key", [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H100 PCIe", "H100"),
                                       ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-80GB", "H200"), ("", "H200")])
def test_a_gpu_takes_its_own_table_where_one_is_committed_else_the_h200s(name, key):
    assert device_key(name) == key
    assert device_table(name) is decode_schedule.MEASURED_BY_DEVICE[key]


def test_the_default_table_is_the_current_devices(monkeypatch):
    """choose_decode_schedule without a table reads the current CUDA device's (one name read per
    device index); a process whose CUDA is not initialized takes the H200's (reading the name would
    initialize it). Checked at a measured cell where the committed H100 and H200 tables differ."""
    differ = [(tokens, adapters, rank) for (rank, tokens, adapters) in sorted(MEASURED_H100)
              if choose_decode_schedule(tokens, adapters, rank, table=MEASURED_H100)
              != choose_decode_schedule(tokens, adapters, rank, table=MEASURED_H200)]
    assert differ, "the committed tables agree everywhere: nothing tells which one was read"
    cell = differ[0]
    h100, h200 = (choose_decode_schedule(*cell, table=t) for t in (MEASURED_H100, MEASURED_H200))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert choose_decode_schedule(*cell) == h200 and device_table() is MEASURED_H200
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 7)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(decode_schedule, "_DEVICE_KEYS", {})
    assert choose_decode_schedule(*cell) == h100 and device_table() is MEASURED_H100


def test_the_committed_runs_as_read(derived):
    """What the committed runs say (chapter 08 section 9): grouping the expand wins at rank 64 from 64
    tokens and 8 per adapter, never at rank 16 by more than the noise; the runs that predate split-K
    are not read."""
    cells = derived["cells"]
    assert {c for c, v in cells.items() if v["schedule"] != "token"} == {(64, 64, 8), (64, 256, 8), (64, 256, 16),
                                                                        (64, 256, 32)}
    assert all(v["schedule"] == "sorted" for c, v in cells.items() if v["schedule"] != "token")
    assert cells[(16, 256, 8)]["deltas"]["sorted"] < 0 < cells[(16, 256, 8)]["deltas"]["sorted"] + NOISE_H200
    assert 0 < NOISE_H200 < 0.02
    assert all(how.startswith("excluded") for name, how in derived["sources"].items()
               if name in ("decode_step_h200.json", "decode_step_fused_h200.json"))


def test_issue_35_grid_cells_take_the_measured_cell_or_the_one_at_or_below(derived):
    rows = derive_decode_rule.grid(derived)
    assert len(rows) == 16  # 8 cells (no more adapters than tokens) x 2 ranks
    for row in rows:
        cell = (row["rank"], row["tokens"], row["adapters"])
        if row["measured"]:
            assert row["schedule"] == MEASURED_H200[cell]
        else:
            below = row["from_cell"]
            assert below is not None and row["schedule"] == MEASURED_H200[below]
            assert below[0] <= cell[0] and below[1] <= cell[1] and below[1] / below[2] <= cell[1] / cell[2]
    unmeasured = {(r["rank"], r["tokens"], r["adapters"]) for r in rows if not r["measured"]}
    assert {a for _, _, a in unmeasured} == {1}, "the committed runs measured no single-adapter step"


TABLE = {(16, 16, 8): "token", (16, 64, 8): "token", (16, 64, 2): "grouped", (64, 64, 8): "sorted",
         (64, 64, 16): "token", (64, 256, 8): "grouped", (64, 256, 32): "sorted", (64, 16, 8): "token"}


@pytest.mark.parametrize("step, want", [
    ((64, 8, 64), "sorted"),    # measured
    ((64, 9, 64), "token"),     # 7.1 tokens per adapter: at or below is 4 (64 x 16)
    ((64, 1, 64), "sorted"),    # 64 per adapter: the most measured at 64 tokens is 8
    ((63, 1, 64), "token"),     # 63 tokens: the 16-token cells
    ((100, 2, 64), "sorted"),   # 100 tokens: the 64-token cells; 50 per adapter
    ((255, 8, 64), "sorted"),
    ((256, 8, 64), "grouped"),
    ((256, 9, 64), "sorted"),   # 28.4 per adapter: 8 (256 x 32)
    ((256, 64, 64), "sorted"),  # 4 per adapter: below every 256-token cell -> the least (8)
    ((8, 1, 64), "token"),      # below every token count: the least (16)
    ((64, 8, 128), "sorted"),   # rank 128: rank 64's cells
    ((64, 8, 32), "token"),     # rank 32: rank 16's
    ((64, 2, 16), "grouped"),   # 32 per adapter (64 x 2)
    ((64, 3, 16), "token"),     # 21.3 per adapter: 8 (64 x 8)
    ((64, 8, 8), "token"),      # rank 8: below every rank -> the least (16)
    ((64, 0, 64), "token"),     # no adapter
])
def test_a_step_takes_the_cell_at_or_below_it(step, want):
    assert choose_decode_schedule(*step, table=TABLE) == want
    cell = derive_decode_rule.nearest_cell(TABLE, step[0], max(step[1], 1), step[2])
    if step[1]:
        assert TABLE[cell] == want


def test_no_table_no_adapter_no_token():
    assert choose_decode_schedule(64, 8, 64, table={}) == "token"
    assert choose_decode_schedule(0, 0, 64) == choose_decode_schedule(64, 0, 64) == "token"


def test_the_expand_schedule_is_the_decode_schedules_part():
    for tokens in (1, 16, 48, 64, 100, 256, 512):
        for adapters in (1, 2, 8, 9, 32):
            for rank in (8, 16, 32, 64, 128):
                want = schedule_parts(choose_decode_schedule(tokens, adapters, rank))[1]
                assert choose_expand_schedule(tokens, adapters, rank) == want
    assert (choose_expand_schedule(64, 8, 64), choose_expand_schedule(64, 16, 64), choose_expand_schedule(64, 8, 16),
            choose_expand_schedule(16, 1, 64)) == ("sorted", "token", "token", "token")  # the docstring's examples


def test_schedule_parts_and_reachable_schedules():
    assert [schedule_parts(s) for s in DECODE_SCHEDULES] == [("token", "token"), ("token", "sorted"),
                                                             ("sorted", "sorted")]
    with pytest.raises(ValueError, match="decode schedule"):
        schedule_parts("slot")
    def rule(tokens, adapters, rank):
        return "grouped" if tokens >= 8 * adapters and tokens >= 32 else "token"
    assert reachable_schedules(1, 16, 64, rule) == {"token"}
    assert reachable_schedules(17, 32, 64, rule) == {"token", "grouped"}
    # the committed tables, named: the default follows the process's GPU once CUDA is initialized, and
    # an xdist worker that ran a GPU test first had the H100's (which takes grouped at 256 x rank 16)
    def h200(tokens, adapters, rank):
        return choose_decode_schedule(tokens, adapters, rank, table=MEASURED_H200)
    assert reachable_schedules(1, 256, 16, h200) == {"token"}
    assert reachable_schedules(17, 64, 64, h200) == {"token", "sorted"}
    assert "grouped" in reachable_schedules(129, 256, 16, lambda *c: choose_decode_schedule(*c, table=MEASURED_H100))


def test_static_views_carry_both_schedules_over_one_set_of_buffers():
    static = StaticLoRABatch(3, 8)
    views = {s: static.batch_info(8, s) for s in DECODE_SCHEDULES}
    assert {s: (v.shrink_schedule, v.expand_schedule) for s, v in views.items()} == {
        s: schedule_parts(s) for s in DECODE_SCHEDULES}
    assert len({v.token_slots.data_ptr() for v in views.values()}) == 1
    assert len({v.permutation.data_ptr() for v in views.values()}) == 1
    assert static.batch_info(8, "grouped") is views["grouped"]
    with pytest.raises(ValueError, match="schedule"):
        static.batch_info(8, "slot")


def test_the_shrink_follows_the_batch_schedule():
    """bgmv_shrink with no schedule argument reads the batch's ``shrink_schedule``: a "grouped" view
    without its permutation is refused (proof that the grouped shrink was asked for); with it, the
    grouped shrink's split partials sum to the reference on the defined columns."""
    g = torch.Generator().manual_seed(8)
    ranks, T, K = [0, 4, 8, 8], 40, 48
    static = StaticLoRABatch(len(ranks), 48, device=DEVICE)
    static.update([1 + (5 * i) % 3 for i in range(T)], 48, 0, ranks, [0.0, 2.0, 0.5, 1.0], ownership_changed=True)
    A = torch.randn(len(ranks), 3 * 8, K, generator=g).to(DEVICE)
    x = torch.randn(48, K, generator=g).to(DEVICE)
    grouped = static.batch_info(48, "grouped")
    with pytest.raises(ValueError, match="permutation"):
        bgmv_shrink(x, A, replace(grouped, permutation=None), torch.zeros(2, 48, 24, device=DEVICE), stack_num=3)
    bgmv_shrink(x, A, replace(static.batch_info(48, "sorted"), permutation=None),
                torch.zeros(2, 48, 24, device=DEVICE), stack_num=3)  # token shrink: no permutation read
    t = bgmv_shrink(x, A, grouped, torch.zeros(2, 48, 24, device=DEVICE), stack_num=3)
    want = torch_ref.bgmv_shrink(x, A, grouped, torch.zeros(48, 24, device=DEVICE), stack_num=3)
    width = 3 * torch.tensor(ranks, device=DEVICE)[grouped.token_slots.long()]
    defined = torch.arange(24, device=DEVICE)[None, :] < width[:, None]
    torch.testing.assert_close(t.sum(0)[defined], want[defined], rtol=1e-4, atol=1e-4)
