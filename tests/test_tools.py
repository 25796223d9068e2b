"""The lab tools in ``tools/`` (marker ``tools``): each still runs against the shipped kernels and
reports what it claims."""

from __future__ import annotations

import pytest


pytest.importorskip("triton")

pytestmark = pytest.mark.tools


def test_instruction_count_script_reads_the_fp8_loop():
    """tools/count_loop_instructions.py (the ALU budget docs/history.md quotes) compiles the e4m3
    loop for sm_90 offline and finds its main loop in the SASS: the loop issues e4m3 MMAs
    (QGMMA). As Hopper launches it (TMA, 2 stages) three programs fit an SM: the shared memory the
    launch settings say (228 KB per SM, 1 KB per program kept by CUDA), registers within the
    budget, no spills, and ptxas keeps the MMAs asynchronous (no C7512/C7513 serialization), also
    masked (capped at the budget); the pointer-load loop (GPUs without TMA) uses its settings'
    shared memory too."""
    from fp4video.kernels import loop_e4m3

    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
        pytest.skip("this Triton ships no nvdisasm")
    script = Path(__file__).resolve().parents[1] / "tools" / "count_loop_instructions.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tma, budget = loop_e4m3.TMA_LAUNCH, loop_e4m3.TMA_REGISTER_BUDGET
    run = subprocess.run([sys.executable, str(script), "--top", "40"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    regs = re.search(r"(\d+) registers, \d+ bytes spill stores", run.stdout)
    assert (regs and 0 < int(regs.group(1)) <= 255) or "no ptxas here took this PTX" in run.stdout, run.stdout
    m = re.search(r"([\d.]+) SASS instructions per element of S", run.stdout)
    assert m and "QGMMA" in run.stdout, run.stdout
    e4m3 = float(m.group(1))
    assert 4 < e4m3 < 40, e4m3
    shared = re.search(r"(\d+) bytes of shared memory", run.stdout)
    # the unmasked loop: at most the launch table's (masked) figure, within 1 KB of it
    table = tma.shared_memory["sm_90"][tma.num_stages]
    assert shared and table - 1024 < int(shared.group(1)) <= table, run.stdout
    assert 3 * (int(shared.group(1)) + 1024) <= 228 * 1024
    if regs:
        assert int(regs.group(1)) <= budget and " 0 bytes spill stores" in run.stdout, run.stdout
        assert 3 * 128 * budget <= 65536
        assert "SERIALIZED" not in run.stdout, run.stdout
    # P̂ reaches the P̂·V̂ MMA without lane exchanges (key_order.as_mma_operand), the block
    # exponents need no cross-lane maximum and l is summed over lanes after the loop: the only
    # shuffles left are the row maximum's, 2 rows per thread × 2 steps = 4 per thread per tile
    shfl = re.search(r"^\s*([\d.]+)\s+SHFL$", run.stdout, re.M)
    assert shfl and float(shfl.group(1)) <= 0.07, run.stdout
    # masked, as launched (capped at the budget): no spills, MMAs still asynchronous
    run = subprocess.run([sys.executable, str(script), "--mask"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    regs = re.search(r"(\d+) registers, \d+ bytes spill stores", run.stdout)
    if regs:
        assert int(regs.group(1)) <= budget and " 0 bytes spill stores" in run.stdout, run.stdout
        assert "SERIALIZED" not in run.stdout, run.stdout
    run = subprocess.run([sys.executable, str(script), "--pointer-loads"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    shared = re.search(r"(\d+) bytes of shared memory", run.stdout)
    pointer = loop_e4m3.POINTER_LAUNCH
    table = pointer.shared_memory["sm_90"][pointer.num_stages]
    assert shared and table - 1024 < int(shared.group(1)) <= table, run.stdout
    # the bf16 NVFP4 loop: bf16 MMAs (HGMMA), more work per element than the e4m3 MXFP4 loop
    run = subprocess.run([sys.executable, str(script), "--kernel", "nvfp4"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    m = re.search(r"_nv_attn_fwd: ([\d.]+) SASS instructions per element of S", run.stdout)
    assert m and "HGMMA" in run.stdout and e4m3 < float(m.group(1)) < 40, run.stdout
    # the ping-pong Gluon NVFP4 kernel: ptxas keeps its MMAs asynchronous (no C7513 serialization);
    # each warpgroup waits for both its MMAs at once (the other warpgroup's softmax is the overlap)
    for flag in ([], ["--no-two-level"]):
        run = subprocess.run([sys.executable, str(script), "--kernel", "nvfp4-sm90", "--top", "40", *flag],
                             capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        assert "_nv_attn_fwd_sm90" in run.stdout and "HGMMA" in run.stdout and "SERIALIZED" not in run.stdout, run.stdout
        waits = re.search(r"MMA waits in the loop \(groups left in flight: count\): (.*)$", run.stdout, re.M)
        assert waits and waits.group(1) == "0: 1", run.stdout


def test_profile_attention_summarizes_ncu_csv(tmp_path):
    """tools/profile_attention.py summarize (the profile table in docs/history.md) reads ncu's raw
    CSV — a header row, a units row, one row per launch — and prints each launch's duration in ms
    (from any time unit), issue and tensor-pipe percentages and stall reasons per issue, whose
    listed sum is the warp cycles per issued instruction."""
    import csv
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "tools" / "profile_attention.py"
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    header = ["ID", "Kernel Name", "gpu__time_duration.sum", "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
              "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
              stall.format("selected"), stall.format("barrier"), stall.format("wait")]
    units = ["", "", "usecond", "%", "%", "inst", "inst", "inst"]
    path = tmp_path / "raw.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header, units, ["0", "_nv_attn_fwd_sm90", "5,170.02", "48.1", "45.3", "1", "0.75", "0.5"]])
    run = subprocess.run([sys.executable, str(script), "summarize", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    row = re.search(r"^\| _nv_attn_fwd_sm90 \| 5\.17 \| 48\.1 \| 45\.3 \| 2\.25 \| 1\.00 \| 0\.75 \| 0\.50 \| nan ",
                    run.stdout, re.M)
    assert row, run.stdout


def test_profile_attention_memory_table_has_a_column_per_launch(tmp_path):
    """``summarize --memory`` adds the L1 / L2 / DRAM throughput metrics ncu reported, one row per
    metric with its unit and one column per launch; other metrics stay out of that table."""
    import csv
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "tools" / "profile_attention.py"
    header = ["ID", "Kernel Name", "gpu__time_duration.sum", "lts__throughput.avg.pct_of_peak_sustained_elapsed",
              "dram__bytes.avg.per_second", "sm__warps_active.avg.pct_of_peak_sustained_active"]
    units = ["", "", "msecond", "%", "Gbyte/s", "%"]
    path = tmp_path / "raw.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header, units, ["0", "_e4m3_attn_fwd", "2.57", "54.65", "1.27", "20"],
                                 ["1", "device_kernel", "2.22", "27.97", "1.45", "30"]])
    run = subprocess.run([sys.executable, str(script), "summarize", "--memory", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| metric (unit) | _e4m3_attn_fwd | device_kernel |" in run.stdout, run.stdout
    assert "| lts__throughput.avg.pct_of_peak_sustained_elapsed (%) | 54.65 | 27.97 |" in run.stdout, run.stdout
    assert "| dram__bytes.avg.per_second (Gbyte/s) | 1.27 | 1.45 |" in run.stdout, run.stdout
    assert "sm__warps_active" not in run.stdout.split("| metric (unit)")[1], run.stdout


def test_profile_attention_source_finds_the_loop_and_its_samples(tmp_path):
    """tools/profile_attention.py source (docs/history.md's stall samples by loop position) reads
    ncu's per-instruction CSV — a "Kernel Name" line, a header, one row per SASS instruction — and
    prints the stall reasons' shares of all samples and, for the main loop (instructions executed
    at least 90% as often as the most executed), each chunk's share of the loop's samples."""
    import csv
    import re
    import subprocess
    import sys
    from pathlib import Path

    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
              "stall_barrier", "stall_wait (Not Issued)"]
    body = [["0x0", "LDC R1, c[0x0][0x28]", "10", "1", "10", "0", "9"],  # prologue: executed once
            ["0x10", "FFMA R2, R3, R4, R5", "30", "100", "30", "0", "0"],
            ["0x20", "MUFU.EX2 R2, R2", "30", "100", "0", "30", "0"],
            ["0x30", "@P0 BRA 0x10", "30", "95", "30", "0", "0"],
            ["0x40", "EXIT", "0", "1", "0", "0", "0"]]
    path = tmp_path / "source.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([["Kernel Name", "_mx_fp8_attn_fwd"], header, *body])
    script = Path(__file__).resolve().parents[1] / "tools" / "profile_attention.py"
    run = subprocess.run([sys.executable, str(script), "source", str(path), "--chunk", "2"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "_mx_fp8_attn_fwd — 100 samples" in run.stdout and "wait 70.0, barrier 30.0" in run.stdout, run.stdout
    assert "instructions 1–3 (3), 90.0% of the samples" in run.stdout, run.stdout
    assert re.search(r"^\| 0–1 \| 66\.7 \| FFMA 1, MUFU 1 \|$", run.stdout, re.M), run.stdout
    assert re.search(r"^\| 2–2 \| 33\.3 \| BRA 1 \|$", run.stdout, re.M), run.stdout
    path.write_text("nothing here\n")
    run = subprocess.run([sys.executable, str(script), "source", str(path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "no 'Kernel Name' blocks" in run.stderr


def test_prepass_bandwidth_replots_its_tables_from_markdown(tmp_path):
    """tools/prepass_bandwidth.py --replot (no GPU) reads the launch tables it printed, as kept
    in docs/history.md — each under its "S = …" line, the --sweep tables (an options column) and
    tables after a new heading (not a "#" comment in a code block) left out — and draws them."""
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    try:
        from prepass_bandwidth import parse_tables
    finally:
        sys.path.pop(0)
    text = """S = 100: bf16 copy of Q 0.162 ms = 4134 GB/s

| launch | ms | GB/s | × copy |
| --- | --- | --- | --- |
| Q: rotate, quantize, e4m3 per row | 0.176 | 2852 | 0.69 |
| whole pre-pass (as the attention call runs it) | 0.689 | 2678 | 0.65 |

| launch | options | ms | × copy |
| --- | --- | --- | --- |
| Q: rotate, quantize, e4m3 per row | {'BLOCKS_PER_PROGRAM': 1} | 0.209 | 0.58 |

S = 200: bf16 copy of Q 0.368 ms = 4210 GB/s

| launch | ms | GB/s | × copy |
| --- | --- | --- | --- |
| V: quantize, e4m3, transposed | 0.491 | 2363 | 0.56 |

### another section

| V: quantize, e4m3, transposed | 9.9 | 1 | 0.01 |
"""
    assert parse_tables(text) == [(100, "Q: rotate, quantize, e4m3 per row", 0.176, 0.69),
                                  (100, "whole pre-pass (as the attention call runs it)", 0.689, 0.65),
                                  (200, "V: quantize, e4m3, transposed", 0.491, 0.56)]
    # one section's tables only (docs/history.md keeps several runs)
    later = "\n### a later run\n\nS = 300: bf16 copy of Q 0.1 ms = 1 GB/s\n\n| launch | ms | GB/s | × copy |\n" \
            "| --- | --- | --- | --- |\n| K: rotate, quantize, e4m3 per key tile | 0.2 | 1 | 0.61 |\n"
    assert parse_tables(text + later, "later run") == [(300, "K: rotate, quantize, e4m3 per key tile", 0.2, 0.61)]
    assert len(parse_tables(text + later)) == 4 and parse_tables(text + later, "no such") == []
    # a shell comment in a code block is no heading: the section's tables after it still count
    code = "\n```bash\n# the commands\npython3 tools/prepass_bandwidth.py\n```\n"
    assert parse_tables(text + later.replace("\nS = 300", code + "\nS = 300"), "later run") == \
        [(300, "K: rotate, quantize, e4m3 per key tile", 0.2, 0.61)]
    md, png = tmp_path / "t.md", tmp_path / "t.png"
    md.write_text(text)
    script = Path(__file__).resolve().parents[1] / "tools" / "prepass_bandwidth.py"
    run = subprocess.run([sys.executable, str(script), "--replot", str(md), "--plot", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert png.stat().st_size > 10_000
    # a --sweep launch name that matches none is an error naming it, not an empty sweep
    run = subprocess.run([sys.executable, str(script), "--sweep", "V", "Kx"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "--sweep Kx: no launch of that name" in run.stderr, run.stderr[-2000:]


def test_prepass_registers_script_reports_q_and_k_launches():
    """tools/prepass_registers.py compiles the pre-pass's Q and K launches for sm_90 offline and
    reports registers, spills, shared memory, programs per SM and the loop's SASS instructions
    per element; --set changes a launch option
    (K at 8 warps); a name that is not one, or a value that is not a number, is refused."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton ships no ptxas")
    from fp4video.kernels.prepass import PREPASS_LAUNCH

    script = Path(__file__).resolve().parents[1] / "tools" / "prepass_registers.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script), "--set", "tile_warps=8"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = re.findall(r"^\| ([QK]): [^|]+\| (\d+) \| (\d+) \| (\w+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) "
                      r"\| ([\d.]+) \(([\d.]+)\) \|$", run.stdout, re.M)
    assert [r[0] for r in rows] == ["Q", "K"] and rows[1][1] == "8", run.stdout
    for _, warps, _, _, regs, spills, shared, programs, warps_per_sm, per_element, fmnmx in rows:
        assert 0 < float(fmnmx) < float(per_element) < 64  # the loop's SASS over a row block's elements
        assert 0 < int(regs) <= 255 and int(shared) > 0 and int(warps_per_sm) == int(programs) * int(warps)
        per_thread = -(-int(regs) // 8) * 8
        assert int(programs) * per_thread * 32 * int(warps) <= 65536
        # compiled as the launcher specializes the launch (unit strides constant): vector loads, no
        # spills at head dim 128 (scalar loads took 255 registers and spilled 348 B in K's launch)
        assert int(spills) == 0 and int(regs) < 255, run.stdout
    assert rows[0][3] == str(PREPASS_LAUNCH.q8_programs_per_sm), run.stdout  # Q's launch: persistent
    bad = subprocess.run([sys.executable, str(script), "--set", "not_an_option=3"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert bad.returncode != 0 and "launch option of PrepassLaunch" in bad.stderr
    bad = subprocess.run([sys.executable, str(script), "--set", "tile_warps=eight"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert bad.returncode != 0 and "must be an integer" in bad.stderr
