"""GPU: where a consumer warpgroup's cycles go in the steady state of the block loop, from
SM clock stamps (DecodeConfig.trace_loop) of the first LOOP_ITERS owned blocks of each WG in
each CTA's first request, plus the producer's stage acquisitions and the transposer's work.

Prints, per shape, the median over CTAs (iterations 4 .. LOOP_ITERS-1, past the pipeline's
fill) of each step of an owned iteration (cycles) and of the iteration's period (two blocks),
and where the producer and transposer were relative to the consumers.

    python3 profiles/experiments/trace_loop.py [--shapes s1,s2,h64] [--tuning '{"kv_stages": 3}']
"""

import argparse
import json

import torch

import snapmla_cute.tuning as ops
from snapmla_cute.bench import time_us
from snapmla_cute.kernels.decode.trace import LOOP_BLOCKS, LOOP_EVENTS, LOOP_ITERS, LOOP_PROD, trace_words
from snapmla_cute.profiling import SHAPES, Shape, make_case

ALL = dict(SHAPES, h64=Shape("b32 h64 s_q1 s_k8192", 32, 64, 1, 8192, False))
EV = list(LOOP_EVENTS)


def traced(c, md, tuning):
    ops.DECODE_TUNING.clear()
    ops.DECODE_TUNING.update(tuning, trace_loop=True)
    for _ in range(3):
        c["step"]()
    grid = md.num_parts * ((md.s_q * md.heads + 63) // 64)
    words = trace_words(md.o_partial, grid, loop=True)
    words.fill_(-1)
    c["step"]()
    torch.cuda.synchronize()
    ops.DECODE_TUNING.clear()
    return words.cpu().to(torch.int64)


def summarize(t):
    lo = 4
    ok = (t[:, : LOOP_PROD] != -1).all(1)
    t = t[ok]
    cons = t[:, :LOOP_PROD].view(-1, 2, LOOP_ITERS, len(EV))
    wrap = lambda x: x % (1 << 32)  # noqa: E731 (32-bit clock)
    lines = [f"CTAs traced {int(ok.sum())}"]
    for wg in range(2):
        c = cons[:, wg, lo:]
        # phases in the order the events happen (variants may reorder them)
        order = sorted(EV, key=lambda e: float(wrap(c[..., LOOP_EVENTS[e]] - c[..., 0]).median()))
        steps = [(order[k], order[k + 1]) for k in range(len(order) - 1)]
        cells = []
        for a, b in steps:
            d = wrap(c[..., LOOP_EVENTS[b]] - c[..., LOOP_EVENTS[a]])
            cells.append(f"{b}={int(d.median())}")
        per = wrap(c[:, 1:, 0] - c[:, :-1, 0])
        cells.append(f"PERIOD(2 blocks)={int(per.median())}")
        wait_next = wrap(c[:, 1:, LOOP_EVENTS['top']] - c[:, :-1, LOOP_EVENTS['qk_issued']])
        cells.append(f"issued->next top={int(wait_next.median())}")
        lines.append(f"  WG{wg}: " + " ".join(cells))
    # producer / transposer per block g (WG g%2 owns block g of the first request, first blocks 0..)
    prod = t[:, LOOP_PROD:LOOP_PROD + LOOP_BLOCKS]
    tr_start = t[:, LOOP_PROD + LOOP_BLOCKS:LOOP_PROD + 2 * LOOP_BLOCKS]
    tr_end = t[:, LOOP_PROD + 2 * LOOP_BLOCKS:LOOP_PROD + 3 * LOOP_BLOCKS]
    gs = torch.arange(2 * lo, 2 * LOOP_ITERS)
    own_wg, own_it = gs % 2, gs // 2
    qk_w = torch.stack([cons[:, w, i, LOOP_EVENTS["qk_waited"]] for w, i in zip(own_wg.tolist(), own_it.tolist())], 1)
    top = torch.stack([cons[:, w, i, LOOP_EVENTS["top"]] for w, i in zip(own_wg.tolist(), own_it.tolist())], 1)
    vt_w = torch.stack([cons[:, w, i, LOOP_EVENTS["vt_waited"]] for w, i in zip(own_wg.tolist(), own_it.tolist())], 1)
    pg = prod[:, gs]
    lines.append(
        "  block g: stage acquired by producer -> owner's top %d; transposer start-end %d; "
        "transposer end -> owner's vt_waited %d; owner's qk_waited -> transposer start %d; "
        "producer acquire period %d"
        % (
            int(wrap(top - pg).median()), int(wrap(tr_end[:, gs] - tr_start[:, gs]).median()),
            int(wrap(vt_w - tr_end[:, gs]).median()), int(wrap(tr_start[:, gs] - qk_w).median()),
            int(wrap(prod[:, gs[1:]] - prod[:, gs[:-1]]).median()),
        )
    )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    # h64 splits its requests: its last slabs may hold partials (traces then garbage)
    ap.add_argument("--shapes", default="s1,s2")
    ap.add_argument("--tuning", default="{}", help="DecodeConfig fields (JSON) for every run")
    args = ap.parse_args()
    tuning = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(args.tuning).items()}
    table = []
    for key in args.shapes.split(","):
        sh = ALL[key]
        c = make_case(sh)
        md = c["metadata"]
        ops.DECODE_TUNING.clear()
        ops.DECODE_TUNING.update(tuning)
        us = time_us(c["step"])
        ops.DECODE_TUNING.update(trace_loop=True)
        us_t = time_us(c["step"])
        print(f"== {sh.name}: {us:.1f} us ({us_t:.1f} traced), parts {md.num_parts}", flush=True)
        print(summarize(traced(c, md, tuning)), flush=True)
        table.append((sh.name, us, us_t))
    for r in table:
        print(f"{r[0]:32s} {r[1]:8.1f} {r[2]:8.1f}")


if __name__ == "__main__":
    main()
