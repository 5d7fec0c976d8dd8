"""GPU: compile (into the disk cache) every decode variant a bench uses, one process per
bench row, so that the bench itself only loads them (a fresh device machine: ~25 s for the
sparse rows instead of a compile per row inside the bench).

    python3 profiles/experiments/warm_bench.py sparse decode && snapmla-cute bench sparse
"""
import multiprocessing, sys, time
from concurrent.futures import ProcessPoolExecutor


def one(row):
    from snapmla_cute.profiling import Shape, make_case, make_sparse_case
    kind, args = row
    t = time.time()
    try:
        if kind == "sparse":
            b, h, s_q, topk, s_k = args
            make_sparse_case(Shape("w", b, h, s_q, s_k, False, topk=topk))
        else:
            b, h, s_q, s_k, causal, varlen = args
            make_case(Shape("w", b, h, s_q, s_k, causal, varlen=varlen))
        return f"{row} {time.time() - t:.0f}s"
    except Exception as e:  # noqa: BLE001
        return f"{row} FAILED {e!r}"


def rows(which):
    from snapmla_cute.bench_sparse import SPARSE_SHAPES, FEW_HEAD_SHAPES
    from snapmla_cute.bench import DECODE_SHAPES
    out = []
    if "sparse" in which:
        out += [("sparse", s) for s in SPARSE_SHAPES + FEW_HEAD_SHAPES]
        # the dense decode beside each sparse row: b*s_q requests of topk tokens
        out += [("dense", (b * s_q, h, 1, topk, False, False)) for b, h, s_q, topk, _ in SPARSE_SHAPES + FEW_HEAD_SHAPES]
    if "decode" in which:
        for s in DECODE_SHAPES:
            b, h, s_q, s_k, varlen = s
            out.append(("dense", (b, h, s_q, s_k, s_q > 1, varlen)))
    return out


if __name__ == "__main__":
    which = sys.argv[1:] or ["sparse"]
    rs = rows(which)
    t = time.time()
    with ProcessPoolExecutor(max_workers=14, mp_context=multiprocessing.get_context("spawn")) as pool:
        for r in pool.map(one, rs):
            print(r, flush=True)
    print(f"warm: {len(rs)} rows in {time.time() - t:.0f}s", flush=True)
