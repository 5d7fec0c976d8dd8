"""GPU: decode time next to the SM clock and board power the GPU held while running it, per
DecodeConfig variant (interleaved rounds), from `nvidia-smi` sampled every 50 ms. For the
question the loop trace raised: do variants with the same cycles per block run at different
clocks?

    python3 profiles/experiments/clock_power.py [--variants JSON] [--seconds 1.5] [--rounds 2]
"""

import argparse
import datetime
import json
import statistics
import subprocess
import time

import torch

from snapmla_cute.tuning import DECODE_TUNING
from snapmla_cute.profiling import SHAPES, make_case

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def run_for(step, seconds):
    """Replays a graph of 10 steps for ``seconds``; returns µs per step."""
    for _ in range(3):
        step()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for _ in range(10):
            step()
    torch.cuda.synchronize()
    n, t0 = 0, time.time()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            g.replay()
        n += 200
        torch.cuda.synchronize()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="s1")
    ap.add_argument("--variants", default='{"default": {}, "one PV temporary": {"pv_temps": 1}}')
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    variants = json.loads(a.variants)
    c = make_case(SHAPES[a.shape])
    for tuning in variants.values():  # compile and check outside the sampled windows
        DECODE_TUNING.clear()
        DECODE_TUNING.update(tuning)
        c["step"]()
    torch.cuda.synchronize()
    smi = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
        stdout=subprocess.PIPE, text=True,
    )
    time.sleep(0.5)
    windows = []
    for rnd in range(a.rounds):
        for name, tuning in variants.items():
            DECODE_TUNING.clear()
            DECODE_TUNING.update(tuning)
            t0 = time.time()
            us = run_for(c["step"], a.seconds)
            windows.append((name, rnd, us, t0 + 0.3, time.time()))  # the first 0.3 s settle
    DECODE_TUNING.clear()
    smi.terminate()
    samples = []
    for line in smi.communicate()[0].strip().splitlines():
        f = [x.strip() for x in line.split(",")]
        try:
            t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((t, float(f[1]), float(f[2]), float(f[3]), f[4]))
        except (ValueError, IndexError):
            continue
    print(f"{'variant':24s} {'round':>5s} {'us':>8s} {'SM MHz':>7s} {'W':>6s} {'C':>4s}  throttle reasons")
    for name, rnd, us, t0, t1 in windows:
        w = [s for s in samples if t0 <= s[0] <= t1]
        if not w:
            print(f"{name:24s} {rnd:5d} {us:8.1f}    (no samples)")
            continue
        mhz = statistics.median(s[1] for s in w)
        watt = statistics.median(s[2] for s in w)
        temp = statistics.median(s[3] for s in w)
        reasons = sorted({s[4] for s in w})
        print(f"{name:24s} {rnd:5d} {us:8.1f} {mhz:7.0f} {watt:6.0f} {temp:4.0f}  {' '.join(reasons)}")


if __name__ == "__main__":
    main()
