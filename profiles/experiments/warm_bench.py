"""GPU: compile (into the disk cache) the decode variants a bench or an experiment uses, one
process per (row, tuning), so that the timing process only loads them. With an empty compile
cache the sparse bench rows take ~25 s this way instead of a compile per row inside the
bench, one after the other.

    python3 profiles/experiments/warm_bench.py sparse decode && snapmla-cute bench sparse
    python3 profiles/experiments/warm_bench.py latency && snapmla-cute bench latency

``warm(items)`` does the same for an experiment's own list: ``("sparse", (b, h, s_q, topk,
s_k), tuning)`` or ``("dense", (b, h, s_q, s_k, causal, varlen), tuning)`` with ``tuning`` the
``DECODE_TUNING`` the timed call will run under (part of the compile key).
"""
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def one(item):
    """Run one call of ``item`` (compiles its variant into the disk cache)."""
    from snapmla_cute.tuning import DECODE_TUNING
    from snapmla_cute.profiling import Shape, make_case, make_sparse_case

    kind, args, tuning = item
    t = time.time()
    DECODE_TUNING.clear()
    DECODE_TUNING.update(tuning)
    try:
        if kind == "sparse":
            b, h, s_q, topk, s_k = args
            make_sparse_case(Shape("w", b, h, s_q, s_k, False, topk=topk))
        else:
            from snapmla_cute import mla_decode

            b, h, s_q, s_k, causal, varlen = args
            c = make_case(Shape("w", b, h, s_q, s_k, causal, varlen=varlen))
            # the bf16-query step too (``bench decode`` times both)
            mla_decode(c["q_bf16"], c["cache"], c["block_table"], c["seqlens"], causal=causal, metadata=c["metadata"])
        return f"{item} {time.time() - t:.0f}s"
    except Exception as e:  # noqa: BLE001
        return f"{item} FAILED {e!r}"
    finally:
        DECODE_TUNING.clear()


def warm(items, jobs: int = 14, verbose: bool = True) -> None:
    """Compile every item's variant in ``jobs`` spawned processes (the caller's process keeps
    no state from them; its later calls hit the disk cache)."""
    items = list(items)
    t = time.time()
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for r in pool.map(one, items):
            if verbose:
                print(r, flush=True)
    print(f"warm: {len(items)} variants in {time.time() - t:.0f}s", flush=True)


def dense_beside(sparse_shapes):
    """The dense decode beside each sparse row (``_dense_us``): b·s_q requests of topk tokens."""
    return [("dense", (b * s_q, h, 1, topk, False, False), {}) for b, h, s_q, topk, _ in sparse_shapes]


def bench_items(which):
    """The rows of ``snapmla-cute bench sparse`` (the dense decode beside each DSA row; the
    ``--few-heads`` rows), of ``bench decode`` and of ``bench latency``, shipped tuning."""
    from snapmla_cute.bench import DECODE_SHAPES
    from snapmla_cute.bench_latency import latency_shapes
    from snapmla_cute.bench_sparse import FEW_HEAD_SHAPES, SPARSE_SHAPES

    out = []
    if "sparse" in which:
        out += [("sparse", s, {}) for s in SPARSE_SHAPES + FEW_HEAD_SHAPES] + dense_beside(SPARSE_SHAPES)
    if "decode" in which:
        out += [("dense", (b, h, s_q, s_k, s_q > 1, varlen), {}) for b, h, s_q, s_k, varlen in DECODE_SHAPES]
    if "latency" in which:
        for kind, b, h, *rest in latency_shapes():  # rest: (s_k,) dense, (topk, s_k) sparse
            args = (b, h, 1, rest[0], False, False) if kind == "dense" else (b, h, 1, *rest)
            out.append((kind, args, {}))
    return out


if __name__ == "__main__":
    warm(bench_items(sys.argv[1:] or ["sparse"]))
