"""The tensor-parallel LoRA benchmark (benchmarks/benchmark_tp_lora.py, issue #14) as a user runs it:
its --smoke mode (gloo on the CPU, tiny sizes) at TP=1 and TP=2, and what its results must say
whatever the machine: TP=2 computes TP=1's logits, and each variant pair adds exactly the
collectives chapter 10 says (none for replicated_A + reduce_with_base; an all-gather per column
module and an all-reduce of the shrink output per row module for fully_sharded + reduce_shrink)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reference.tp.lora import tp_unavailable_reason

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    reason = tp_unavailable_reason("gloo", 2)
    if reason is not None:
        pytest.skip(f"two-process TP needs gloo: {reason}")
    out = tmp_path_factory.mktemp("tp") / "tp.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "benchmark_tp_lora.py"), "--smoke", "--out",
                          str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_tp2_computes_tp1s_logits(smoke):
    assert set(smoke["results"]) == {"1", "2"} and not smoke["skipped"]
    diffs = smoke["logits_max_rel_diff_vs_tp1"]
    assert len(diffs) == 4 and max(diffs.values()) < 1e-4, diffs  # fp32: only the sums' order differs
    assert {t["target"].split("(")[1].rstrip(")") for t in smoke["targets"]} == set(smoke["results"]["2"])


def test_each_variant_pair_adds_the_collectives_chapter_10_names(smoke):
    o = smoke["options"]
    layers, R, T, hidden, bytes_ = o["layers"], o["rank"], o["seqs"], o["sizes"]["hidden"], 4  # fp32
    base_only = smoke["results"]["2"]["replicated_A+reduce_with_base/decode"]["collectives"]
    assert [(c["op"], c["bytes"], c["base_count"], c["lora_count"]) for c in base_only] == \
        [("all_reduce", T * hidden * bytes_, 2 * layers, 2 * layers)]  # o and down: the base's own
    sharded = {(c["op"], c["bytes"]): (c["base_count"], c["lora_count"])
               for c in smoke["results"]["2"]["fully_sharded+reduce_shrink/decode"]["collectives"]}
    assert sharded == {("all_gather", T * 3 * R * bytes_): (0, layers),  # qkv's shrink output, R per part
                       ("all_gather", T * 2 * R * bytes_): (0, layers),  # gate_up's
                       ("all_reduce", T * R * bytes_): (0, 2 * layers),  # o's and down's shrink outputs
                       ("all_reduce", T * hidden * bytes_): (2 * layers, 2 * layers)}
    for row in smoke["results"]["1"].values():  # one rank: nothing to communicate, nothing timed
        assert row["base_collective_us"] == row["lora_collective_us"] == 0
