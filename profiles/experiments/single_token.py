"""GPU check of requests with one key token (out = that token's V for every row, whatever
q is): run many fresh batches and report every element that differs from the emulation by
more than one bf16 ulp (the one failure of merge_stress.py was such a batch).

    python profiles/experiments/single_token.py [batches]
"""

import random
import sys

import torch

sys.path.insert(0, "tests")
from decode_cases import build_case, references  # noqa: E402

from snapmla_cute import decode_metadata, mla_decode  # noqa: E402
from snapmla_cute import reference as ref  # noqa: E402


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    rng = random.Random(7)
    configs = [(128, 2, [1, 0, 0], 16), (128, 1, [1], 66), (128, 2, [1], 1), (64, 1, [1, 0], 8), (128, 1, [2, 0, 1], 16)]
    bad_calls = 0
    for k in range(n):
        h, s_q, lens, parts = configs[k % len(configs)]
        c = build_case(len(lens), s_q, h, 64, lens, seed=rng.randint(0, 1 << 30))
        md = decode_metadata(c["cache_seqlens"], s_q=s_q, heads=h, num_parts=parts)
        (_, _), (oe, le) = references(c, False)
        for it in range(4):
            out = torch.full((len(lens), s_q, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
            out, lse = mla_decode(c["q"], c["cache"], c["block_table"], c["cache_seqlens"], metadata=md, out=out)
            want = oe.bfloat16().float()
            got = out.float()
            ulp = torch.where(want == 0, torch.full_like(want, 2.0**-133), want.abs() * 2.0**-7)
            far = ((got - want).abs() > ulp * 1.01) | torch.isnan(got)
            rel = ref.rel_l2(got, want)
            if far.any() or rel > 2e-3:
                bad_calls += 1
                idx = far.nonzero()[:6].tolist()
                print(f"h{h} s_q{s_q} lens{lens} parts{parts} call{it}: rel {rel:.2e}, {int(far.sum())} elements > 1 ulp at {idx}; "
                      f"got {[float(got[tuple(i)]) for i in idx]} want {[float(want[tuple(i)]) for i in idx]}", flush=True)
    print(f"single-token: {n} batches x 4 calls, {bad_calls} calls with an element > 1 ulp off", flush=True)


if __name__ == "__main__":
    main()
