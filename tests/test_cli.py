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
