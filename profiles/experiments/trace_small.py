"""GPU: where a batch-1 decode's time goes, from the kernel's %globaltimer stamps
(``DecodeConfig.trace``), b1 h128 s_k640 on three plans:

* the shipped call of a metadata that states its length (``bench.decode_case``:
  ``max_seqlen``), which takes the head-group plan: 8 kernel requests of 16 heads, each on
  a cluster of k = 8 CTAs merged on-chip;
* the head-group plan at k = 4;
* the plain plan (``head_groups=1``: 64-row tiles, the split plan over 66 parts).

Each call is timed (graph replay, untraced), then traced once after warm-up calls; the
milestones print as median / max ns over the CTAs with KV work, from the earliest CTA's
start (consumer milestones once per consumer warpgroup). In the cluster merge
``count_seen`` marks every peer's stages free and ``merged`` every peer's rows arrived.

    python3 profiles/experiments/trace_small.py
"""

from __future__ import annotations

import torch

GROUP = 16
CONSUMER_EVENTS = ("q_arrived", "qk_done", "softmax_done", "pv_done", "epilogue_done", "exit")
PLAN_EVENTS = ("start", "lengths_read", "splits_counted", "part_planned")


def summarize(t) -> str:
    from snapmla_cute.kernels.decode.trace import TRACE_EVENTS

    t0 = int(t[:, TRACE_EVENTS["start"]][t[:, TRACE_EVENTS["start"]] != -1].min())
    rel = (t - t0) % (1 << 32)  # the stamps are the timer's low 32 bits
    rel[t == -1] = -1
    work = t[:, TRACE_EVENTS["kv_issued"]] != -1
    lines = [f"CTAs {t.shape[0]}, with KV work {int(work.sum())}"]
    order = list(PLAN_EVENTS) + [k for k in TRACE_EVENTS if k not in PLAN_EVENTS and k != "smid"]
    for k in order:
        v = TRACE_EVENTS[k]
        cells = []
        for col in [v] + ([v + 16] if k in CONSUMER_EVENTS or bool((t[work, v + 16] != -1).any()) else []):
            x = rel[work, col]
            x = x[x >= 0]
            cells.append(f"{int(x.median()):6d}/{int(x.max()):6d}" if len(x) else "     -/     -")
        lines.append(f"  {k:14s} " + "  ".join(cells))
    idle = rel[~work, TRACE_EVENTS["exit"]]
    idle = idle[idle >= 0]
    if len(idle):
        lines.append(f"  idle CTAs exit {int(idle.median())}/{int(idle.max())}")
    return "\n".join(lines)


def traced(call, md) -> torch.Tensor:
    from snapmla_cute.kernels.decode.trace import trace_words
    from snapmla_cute.tuning import DECODE_TUNING

    DECODE_TUNING.update(trace=True)
    try:
        for _ in range(4):
            call()
        rows = md.s_q * md.heads // md.head_groups  # a kernel request's
        words = trace_words(md.o_partial, md.num_parts * ((rows + 63) // 64))
        words.fill_(-1)
        call()
        torch.cuda.synchronize()
        return words.cpu().to(torch.int64)
    finally:
        DECODE_TUNING.clear()


def main():
    from snapmla_cute import decode_metadata, mla_decode
    from snapmla_cute.bench import decode_case
    from snapmla_cute.timing import time_us

    b, h, s_k = 1, 128, 640
    c = decode_case(b, h, 1, [s_k] * b, 64, False)
    rows = []

    def run(name, m, call):
        us = time_us(call)
        rows.append((name, m.num_parts, m.cluster, us))
        print(f"== b{b} h{h} s_k{s_k} {name}: {m.num_parts} parts, k {m.cluster}, {us:.1f} µs; traced, ns:")
        print(summarize(traced(call, m)), flush=True)

    run("shipped (head groups)", c.metadata, c.serving_call())
    out, lse = torch.empty_like(c.out), torch.empty_like(c.lse)
    for name, kw in (("head groups, k 4", dict(head_groups=h // GROUP, cluster=4)), ("plain", dict(head_groups=1))):
        md = decode_metadata(c.seqlens, s_q=1, heads=h, **kw)
        run(name, md, lambda md=md: mla_decode(c.qq, c.cache, c.block_table, c.seqlens, metadata=md, out=out,
                                               lse=lse, check=False))
    for r in rows:
        print(f"{r[0]:36s} parts {r[1]:3d} k {r[2]}  {r[3]:6.1f} µs")


if __name__ == "__main__":
    main()
