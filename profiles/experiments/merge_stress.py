"""GPU stress of the in-kernel plan and split merge (the open risk in profiles/merge.md).

1. Is the launch really cooperative? A grid larger than the GPU can hold at once must be
   refused by the driver (run in a child process: lengths all 0, so nothing waits).
2. Random batches for a time budget: lengths with zeros and block edges, 1 to 132 CTAs,
   s_q 1/2, h 16/64/128; per batch, `reps` calls with the split buffers and outputs
   poisoned with NaN before each. Each call must be free of NaN, bit-identical to the
   first, the first within the emulation tolerance, and the counters back at zero.

    python profiles/experiments/merge_stress.py [seconds] [reps]
"""

import random
import subprocess
import sys
import time

import torch

sys.path.insert(0, "tests")
from decode_cases import build_case, references  # noqa: E402

from snapmla_cute import decode_metadata, mla_decode  # noqa: E402
from snapmla_cute import reference as ref  # noqa: E402
from snapmla_cute.planning import DecodeMetadata  # noqa: E402

EMU_REL, EMU_LSE = 2e-3, 1e-3

CHILD = r"""
import sys, torch
sys.path.insert(0, "tests")
from decode_cases import build_case
from snapmla_cute import mla_decode
from snapmla_cute.planning import DecodeMetadata
sms = torch.cuda.get_device_properties(0).multi_processor_count
c = build_case(2, 1, 128, 64, [0, 0], seed=1)
md = DecodeMetadata(2, 1, 128, 2 * sms, "cuda")  # 4 x SMs CTAs of one per SM: cannot all be resident
try:
    mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md)
    torch.cuda.synchronize()
    print("LAUNCHED")
except Exception as e:
    print("REFUSED", type(e).__name__, str(e).splitlines()[0][:200])
"""


def cooperative_check():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("LAUNCHED", "REFUSED"))]
    return (lines[-1] if lines else f"no result (rc {r.returncode}): {r.stderr[-300:]}")


def main():
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 120.0
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    print("oversized grid:", cooperative_check(), flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rng = random.Random(int(time.time()))
    t_end = time.time() + budget
    n = fails = calls = 0
    while time.time() < t_end:
        h = rng.choice([128, 128, 64, 16])
        s_q = rng.choice([1, 1, 2])
        causal = s_q > 1 and rng.random() < 0.5
        b = rng.choice([1, 1, 2, 3, 5, 8, 12])
        lens = [rng.choice([0, 1, 63, 64, 65, 640, rng.randint(0, 3000), rng.randint(0, 9000)]) for _ in range(b)]
        m_tiles = (s_q * h + 63) // 64
        parts = rng.choice([1, rng.randint(1, sms // m_tiles), sms // m_tiles, sms // m_tiles])
        c = build_case(b, s_q, h, 64, lens, seed=rng.randint(0, 1 << 30))
        md = decode_metadata(c["cache_seqlens"], s_q=s_q, heads=h, num_parts=parts)
        (_, _), (oe, le) = references(c, causal)
        first = None
        bad = None
        for it in range(reps):
            md.o_partial.fill_(float("nan"))
            md.lse_partial.fill_(float("nan"))
            out = torch.full((b, s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
            lse = torch.full((b, h, s_q), float("nan"), device="cuda")
            mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], causal=causal, metadata=md,
                       out=out, lse=lse, check=False)
            calls += 1
            if torch.isnan(out.float()).any() or torch.isnan(lse).any():
                rows = torch.isnan(out.float()).any(-1).nonzero()[:4].tolist()
                bad = f"call {it}: NaN at (b, s_q, h) {rows}"
                break
            if first is None:
                first = (out.clone(), lse.clone())
                err = ref.rel_l2(out.float(), oe.bfloat16().float())
                lerr = ref.lse_max_abs(lse, le)
                if err > EMU_REL or lerr > EMU_LSE:
                    bad = f"vs emulation rel {err:.2e} lse {lerr:.1e}"
                    break
            elif not (torch.equal(out, first[0]) and torch.equal(lse, first[1])):
                bad = f"call {it} differs from call 0"
                break
            if not torch.all(md.counters == 0):
                bad = f"call {it}: counters {md.counters.cpu().tolist()}"
                break
        n += 1
        if bad:
            fails += 1
            print(f"FAIL h{h} s_q{s_q} causal={causal} parts{parts} lens{lens}: {bad}", flush=True)
    print(f"merge stress: {n} batches, {calls} calls, {fails} failures", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
