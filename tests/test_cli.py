import subprocess
import sys

from snapmla_cute.cli import main


def test_help_runs():
    r = subprocess.run([sys.executable, "-m", "snapmla_cute.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "accuracy" in r.stdout and "compile" in r.stdout


def test_accuracy_command_prints_the_table(capsys):
    assert main(["accuracy", "--lengths", "256", "--batch", "1", "--heads", "16", "--seeds", "0"]) == 0
    out = capsys.readouterr().out
    for word in ("SnapMLA", "A: RoPE-unaware", "B: per-tensor static", "C: per-tensor dynamic", "D: per-block", "flashmla", "paper"):
        assert word in out


def test_compile_command_reports_every_kernel(capsys):
    assert main(["compile", "--arch", "sm_90a", "--quick"]) == 0
    out = capsys.readouterr().out
    for name in ("quant_q", "append_kv", "dequant_kv"):
        assert name in out


def test_every_subcommand_has_help():
    for cmd in ("accuracy", "compile", "bench", "profile", "layouts"):
        r = subprocess.run([sys.executable, "-m", "snapmla_cute.cli", cmd, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and "usage" in r.stdout, (cmd, r.stderr)


def test_profile_command_line_and_summary(monkeypatch, capsys):
    from snapmla_cute import profiling

    cmd = profiling.ncu_command("s1", "/tmp/rep", "ncu")
    assert cmd[:3] == ["ncu", "--clock-control", "none"]
    assert "--profile-from-start" in cmd and cmd[-1] == "s1"
    for sec in ("SpeedOfLight", "MemoryWorkloadAnalysis", "WarpStateStats", "SourceCounters"):
        assert sec in cmd
    assert main(["profile", "s9"]) == 2  # unknown shape: refused before anything runs

    details = [
        {"ID": "0", "Kernel Name": "kernel_cutlass_kernel_snapmla_cutekernelsdecodeDecodeKernel_x",
         "Section Name": "GPU Speed Of Light Throughput", "Metric Name": "DRAM Throughput",
         "Metric Unit": "%", "Metric Value": "40.87"},
        {"ID": "1", "Kernel Name": "kernel_cutlass_kernel_snapmla_cutekernelsdecode_combineDecodeCombineKernel_x",
         "Section Name": "GPU Speed Of Light Throughput", "Metric Name": "Duration",
         "Metric Unit": "us", "Metric Value": "16.74"},
    ]
    raw = [{"ID": "0", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "29.28",
            "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": "0.99"}]
    monkeypatch.setattr(profiling, "_csv", lambda ncu, rep, page: details if page == "details" else raw)
    text = profiling.summarize("x.ncu-rep")
    assert "[0] DecodeKernel" in text and "DRAM throughput            40.87 %" in text
    assert "tensor pipe active         29.28 % of peak" in text and "barrier 0.99" in text
    assert "[1] Combine" in text and "16.74 us" in text
