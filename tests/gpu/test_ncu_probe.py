"""ncu_probe.py's ``--stalls`` reading of an Nsight Compute source page (CSV): on a page laid out as ncu
writes one (its notes before the header, counts with thousands separators, each stall reason twice: all
samples and not-issued ones)."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

HEAD = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_barrier",
        "stall_selected", "stall_long_sb", "stall_barrier (Not Issued)", "stall_selected (Not Issued)",
        "stall_long_sb (Not Issued)"]  # fmt: skip
ROWS = [
    # a loop body: two instructions run 25,088 times
    ["0x10", "      HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR16], R24", "300", "25,088", "0", "300", "0",
     "0", "0", "0"],
    ["0x20", "@P3   SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR19+0x38020], RZ", "1,100", "25,088", "1,000", "100", "0",
     "1,000", "0", "0"],
    # idle warps, at a barrier all kernel long: run twice
    ["0x30", "      NOP", "2,400", "264", "2,400", "0", "0", "2,400", "0", "0"],
    # the loading warp's wait
    ["0x40", "@!P0  BRA 0x7f96290207e0", "200", "6,272", "0", "0", "200", "0", "0", "200"],
]  # fmt: skip


@pytest.fixture(scope="module")
def ncu_probe():
    spec = importlib.util.spec_from_file_location("ncu_probe", Path(__file__).with_name("ncu_probe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stalls_groups_samples_by_instruction_count(ncu_probe, tmp_path):
    page = tmp_path / "case.sass.csv"
    with page.open("w", newline="") as f:
        f.write("==PROF== Connected to process 1\n")
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(HEAD)
        w.writerows(ROWS)
    out = ncu_probe.stalls(page).splitlines()
    assert out[0] == "== case.sass.csv: 4 instructions, 4000 samples"
    # the instructions by samples, each with its largest reasons (the not-issued columns left out)
    assert out[1].startswith("   60.0%       NOP") and out[1].endswith("x264 | barrier 60.0")
    assert "SYNCS.ARRIVE" in out[2] and out[2].endswith("| barrier 25.0, selected 2.5")
    assert "by reason: barrier 85.0%, selected 10.0%, long_sb 5.0%" in "\n".join(out)
    at = out.index("  by times executed (a group: the instructions run that many times, warps summed):")
    groups = out[at + 1 :]
    assert groups == [
        "    x264 (1 instructions) 60.0%: barrier 60.0",
        "    x25088 (2 instructions) 35.0%: barrier 25.0, selected 10.0",
        "    x6272 (1 instructions) 5.0%: long_sb 5.0",
    ]
