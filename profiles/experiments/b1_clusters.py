"""GPU: batch 1 (and 2, 4) on the split plan against the cluster plan at k = 2 / 4 / 8 (a
request's k portions on the k CTAs of a cluster, merged on-chip; ``num_parts`` = k or 2k):
graph-replay µs, and each output's distance from the first row's (the split plan).

    python3 profiles/experiments/b1_clusters.py
"""
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor


def _compile(item):
    from snapmla_cute.kernels.decode import compile as dc
    from snapmla_cute.kernels.decode.config import DecodeConfig
    from snapmla_cute.kernels.decode.step import DecodeSparseStepConfig, DecodeStepConfig
    kind, h, k = item
    kw = {"cluster": k} if k > 1 else {}
    if kind == "sparse":
        dc.compile_sparse(DecodeSparseStepConfig(DecodeConfig(h, 1, 1, False, sparse=True, **kw), 1))
    else:
        dc.compile_step(DecodeStepConfig(DecodeConfig(h, 1, 64, False, **kw)))
    return item


SPARSE = [(1, 8, 2048), (1, 128, 2048), (2, 8, 2048), (4, 8, 2048)]
DENSE = [(1, 128, 640)]
CONFIGS = [(None, 1), (2, 2), (4, 4), (8, 8), (16, 8), (4, 2), (8, 4)]


def sweep(rows, name, metadata, call):
    """Time ``call(md, out, lse, check)`` on ``metadata(parts)`` for every (parts, k) of
    CONFIGS (k set on the metadata), each output against the first config's."""
    import torch

    from snapmla_cute.bench import time_us

    base = None
    for P, k in CONFIGS:
        try:
            md = metadata(P)
            if P is not None:
                md.cluster = k
            out, lse = call(md, None, None, True)
            torch.cuda.synchronize()
            us = time_us(lambda: call(md, out, lse, False))
            if base is None:
                base = (out.float().clone(), lse.clone())
            d = ((out.float() - base[0]).norm() / base[0].norm()).item()
            dl = (lse - base[1]).abs().max().item()
            rows.append([name, md.num_parts, md.cluster, round(us, 1), f"{d:.1e}", f"{dl:.1e}"])
        except Exception as e:  # noqa: BLE001
            rows.append([name, P, k, "-", type(e).__name__, str(e)[:60]])
        print(rows[-1], flush=True)


def main():
    from tabulate import tabulate

    from snapmla_cute import decode_metadata, mla_decode, mla_decode_sparse, sparse_decode_metadata
    from snapmla_cute.bench_sparse import sparse_case
    from snapmla_cute.profiling import Shape, make_case

    rows = []
    for b, h, topk in SPARSE:
        cache, _, qq, idx, _ = sparse_case(b, h, 1, topk, 8192)
        sweep(rows, f"sparse b{b} h{h} topk{topk}",
              lambda P: sparse_decode_metadata(b, 1, h, topk, num_parts=P),  # noqa: B023
              lambda md, out, lse, check: mla_decode_sparse(qq, cache, idx, metadata=md, out=out, lse=lse,  # noqa: B023
                                                            check=check))
    for b, h, s_k in DENSE:
        c = make_case(Shape("d", b, h, 1, s_k, False))
        args = (c["q"], c["cache"], c["block_table"], c["seqlens"])
        sweep(rows, f"dense b{b} h{h} s_k{s_k}",
              lambda P: decode_metadata(c["seqlens"], s_q=1, heads=h, num_parts=P),  # noqa: B023
              lambda md, out, lse, check: mla_decode(*args, metadata=md, out=out, lse=lse, check=check))  # noqa: B023
    print(tabulate(rows, headers=["shape", "parts", "k", "us", "rel vs first", "lse diff"]))


if __name__ == "__main__":
    t = time.time()
    work = [("sparse", h, k) for h in (8, 128) for k in (1, 2, 4, 8)] + [("dense", 128, k) for k in (1, 2, 4, 8)]
    with ProcessPoolExecutor(max_workers=12, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile, work))
    print(f"compiled {len(work)} in {time.time() - t:.0f}s", flush=True)
    main()
