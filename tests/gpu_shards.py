"""Runs the GPU tests as N pytest processes over disjoint shards (the device machine has 16
cores, and a cold compile cache costs ~9 s per decode variant in one process; the processes
share the disk cache). GPU work itself is time-sliced between the processes.

    python3 tests/gpu_shards.py -n 4 [--gpus G] [-k EXPR] [--log-dir DIR]

``--gpus G`` deals the shards over G visible GPUs (shard i on GPU i % G); a shard then sees
one GPU, so the two-GPU test skips there and runs on its own.

Prints each shard's summary line; exits non-zero if any shard failed.
"""

import argparse
import os
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("-k", default=None)
    ap.add_argument("--gpus", type=int, default=1, help="visible GPUs to deal the shards over")
    ap.add_argument("--log-dir", default=".")
    ap.add_argument("--timeout", type=float, default=600, help="seconds; then every shard still running is killed")
    ap.add_argument("paths", nargs="*", default=["tests"])
    a = ap.parse_args()
    sel = ["-m", "gpu"] + (["-k", a.k] if a.k else [])
    ids = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", *sel, *a.paths],
        capture_output=True, text=True, check=True,
    ).stdout.split("\n")
    ids = [i for i in ids if "::" in i]
    # consecutive ids share compiled variants: deal them out in runs, not round-robin
    per = (len(ids) + a.n - 1) // a.n
    shards = [ids[i * per : (i + 1) * per] for i in range(a.n)]
    os.makedirs(a.log_dir, exist_ok=True)
    # the GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (all when unset)
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = parent.split(",") if parent else [str(g) for g in range(a.gpus)]
    if a.gpus > len(visible):
        sys.exit(f"--gpus {a.gpus}: only {len(visible)} visible (CUDA_VISIBLE_DEVICES={parent})")
    t0 = time.time()
    procs = []
    for i, shard in enumerate(shards):
        if not shard:
            continue
        log = open(os.path.join(a.log_dir, f"gpu_shard{i}.log"), "w")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible[i % a.gpus]) if a.gpus > 1 else None
        procs.append((i, log, subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *shard],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
        )))
    rc = 0
    for i, log, p in procs:
        try:
            rc |= p.wait(timeout=max(1.0, a.timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:  # a hung kernel must not hold the GPU for the rest of the call
            os.killpg(p.pid, 9)
            p.wait()
            rc |= 1
            log.write(f"\nshard {i}: killed after {a.timeout:.0f} s\n")
        log.close()
        tail = open(log.name).read().strip().split("\n")[-1]
        print(f"shard {i}: {tail}")
    print(f"{len(ids)} GPU tests in {len(procs)} shards, {time.time() - t0:.0f} s, rc {rc}")
    sys.exit(rc)


if __name__ == "__main__":
    main()
