"""``snapmla-cute``: command-line entry points (accuracy, compile, bench, layouts)."""

from __future__ import annotations

import argparse
import os
import sys

from snapmla_cute.format import Q_PRECISIONS


def _accuracy(args):
    from snapmla_cute.accuracy import accuracy_study, print_accuracy

    rows = accuracy_study(
        lengths=args.lengths, dists=args.data, batch=args.batch, heads=args.heads, seeds=args.seeds,
        device=args.device, table=args.table, q_precisions=args.q_precision, rotate=args.rotate,
    )
    print_accuracy(rows, markdown=args.markdown)


def _compile(args):
    from snapmla_cute.compile_report import all_variants, compile_report, print_report, violations

    variants = all_variants(full=not args.quick)
    if args.kernels:
        variants = [v for v in variants if v[0] in args.kernels]
    rows = compile_report(arch=args.arch, variants=variants, jobs=args.jobs)
    print_report(rows)
    if args.sass_digest:
        from snapmla_cute.compile_report import write_digests

        write_digests(rows, args.sass_digest)
        print(f"SASS digests of {len(rows)} variants written to {args.sass_digest}")
    bad = violations(rows)
    for line in bad:
        print(f"FAIL {line}", file=sys.stderr)
    print(f"{len(rows)} variants compiled for {args.arch}; {len(bad)} violations")
    return 1 if bad else 0


def _bench(args):
    from snapmla_cute.bench import bench_decode, bench_fused, device_copy_tbps, print_table

    name, tbps = device_copy_tbps()
    print(f"device: {name}; anchor copy bandwidth {tbps} TB/s (tables use the copy measured now)")
    if args.what in ("decode", "latency") and args.peers:
        from snapmla_cute.peers import flashinfer_jit_report

        line = flashinfer_jit_report()  # builds its JIT modules first, so the rows time no build
        if line:
            print(line, flush=True)
    if args.what == "fused":
        print_table(bench_fused(tokens=args.tokens, page_size=args.page_size), json_path=args.json)
    elif args.what == "cp":
        import torch.distributed as dist

        from snapmla_cute.bench_cp import bench_cp

        if "LOCAL_RANK" in os.environ and not dist.is_initialized():  # under torchrun
            import torch

            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group("nccl")
        rows = bench_cp(page_size=args.page_size, world=args.world)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print_table(rows, json_path=args.json)
    elif args.what == "sparse":
        from snapmla_cute.bench_sparse import FEW_HEAD_SHAPES, bench_sparse

        if args.few_heads:
            rows = bench_sparse(FEW_HEAD_SHAPES, page_size=args.page_size, few_heads=True, peers_here=args.peers)
        else:
            rows = bench_sparse(page_size=args.page_size, peers_here=args.peers)
        print_table(rows, json_path=args.json)
    elif args.what == "latency":
        from snapmla_cute.bench_latency import bench_latency

        print_table(bench_latency(page_size=args.page_size, peers_here=args.peers), json_path=args.json)
    else:
        from snapmla_cute.bench import DECODE_SHAPES, plot_rows

        shapes = list(DECODE_SHAPES) if not args.shape or args.with_standard else []
        for spec in args.shape or []:
            parts = spec.split(",")
            try:
                b, h, s_q, s_k = (int(v) for v in parts[:4])
            except ValueError:
                print(f"--shape {spec!r}: expected b,h,s_q,s_k[,varlen]")
                return 2
            shapes.append((b, h, s_q, s_k, len(parts) > 4 and parts[4] == "varlen"))
        rows = bench_decode(shapes=shapes, page_size=args.page_size, peers_here=args.peers, accurate=args.accurate)
        print_table(rows, json_path=args.json)
        if args.plot:
            plot_rows(rows, args.plot)
            print(f"chart written to {args.plot}")


def _profile(args):
    import os
    import subprocess

    from snapmla_cute import profiling

    ncu = args.ncu or profiling.ncu_binary()
    if args.summarize:
        print(profiling.summarize(args.summarize, ncu or "ncu"))
        return 0
    if ncu is None:
        print("ncu (Nsight Compute) not found: install it or pass --ncu PATH", flush=True)
        return 2
    bad = [k for k in args.shapes if k not in profiling.SHAPES]
    if bad:
        print(f"unknown shape {bad}: expected some of {sorted(profiling.SHAPES)}")
        return 2
    os.makedirs(args.out, exist_ok=True)
    for key in args.shapes:
        report = os.path.join(args.out, f"decode_{key}")
        print(f"profiling {profiling.SHAPES[key].name} -> {report}.ncu-rep", flush=True)
        subprocess.run(profiling.ncu_command(key, report, ncu), check=True)
        text = profiling.summarize(report + ".ncu-rep", ncu)
        with open(os.path.join(args.out, f"decode_{key}.txt"), "w") as f:
            f.write(f"{profiling.SHAPES[key].name}\n{text}\n")
        print(text, flush=True)
        # per-SASS-instruction stall samples (the SourceCounters section), for reading
        # where the warps wait; large, so it stays next to the report, out of git
        try:
            sass_csv = profiling.source_csv(report + ".ncu-rep", ncu)
            with open(os.path.join(args.out, f"decode_{key}_sass.csv"), "w") as f:
                f.write(sass_csv)
        except subprocess.CalledProcessError as e:
            print(f"no per-instruction page ({e})", flush=True)
    return 0


def _layouts(args):
    from snapmla_cute.layouts import p_permute, smem, transpose

    for kind in ("content", "vt", "rope", "p"):
        print(smem.render(kind, rows=args.rows, cols=args.cols))
        print()
    # The kernel keeps Vᵀ and P in the token order π: these show where each token lands.
    for kind in ("vt", "p"):
        print(transpose.render_tokens(kind, rows=args.rows, cols=args.cols))
        print()
    print("P bytes per lane of a quad, one 32-column k block (label = 32*rowpair + col):")
    for lane in range(4):
        print(f"  lane {lane}: C order           {p_permute.c_layout_labels(lane)}")
        print(f"          π order (shipped) {p_permute.pi_packed_labels(lane)}")
        print(f"          natural order     {p_permute.permuted_labels(lane)}")
    if args.png:
        import os

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        os.makedirs(args.png, exist_ok=True)
        for kind in ("content", "vt", "rope", "p"):
            # Vᵀ and P by token in the order π (what the kernel ships); the others by byte.
            ax = transpose.plot_tokens(kind) if kind in ("vt", "p") else smem.plot(kind)
            path = os.path.join(args.png, f"{kind}.png")
            ax.figure.savefig(path, dpi=80, bbox_inches="tight")
            plt.close(ax.figure)
            print(f"wrote {path}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="snapmla-cute", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("accuracy", help="error vs float64: SnapMLA, Configs A-D, FlashMLA's FP8 formats; error budget (CPU)")
    a.add_argument("--data", nargs="+", default=["flashmla", "paper"], choices=["flashmla", "paper", "realistic", "stress"],
                   help="data sets (snapmla_cute.accuracy describes each)")
    a.add_argument("--table", default="formats", choices=["formats", "budget", "p"],
                   help="formats: every format; budget: each quantization step alone; p: P quantization variants")
    a.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    a.add_argument("--batch", type=int, default=4)
    a.add_argument("--heads", type=int, default=64)
    a.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3], help="metrics: mean (LSE: max) over seeds")
    a.add_argument("--q-precision", nargs="+", default=["e4m3"], choices=Q_PRECISIONS,
                   help="formats table: SnapMLA's row per query precision (e4m3x2: content as hi + lo e4m3)")
    a.add_argument("--rotate", default="off", choices=["off", "on", "both"],
                   help="Q and K content rotated by a random-sign Walsh-Hadamard matrix (output rotated back); both: each row twice")
    a.add_argument("--device", default="cpu")
    a.add_argument("--markdown", action="store_true", help="print a GitHub-markdown table")
    a.set_defaults(func=_accuracy)

    c = sub.add_parser("compile", help="compile every kernel variant (no GPU needed) and report SASS facts")
    c.add_argument("--arch", default="sm_90a")
    c.add_argument("--quick", action="store_true", help="main decode variants only")
    c.add_argument("--kernels", nargs="+", help="only these kernels (e.g. decode decode_step)")
    c.add_argument("--jobs", type=int, default=2, help="parallel compile processes")
    c.add_argument("--sass-digest", metavar="FILE",
                   help="write {variant: sha256 of its SASS, kernel symbols normalized} as JSON")
    c.set_defaults(func=_compile)

    b = sub.add_parser("bench", help="time the kernels on the GPU and print a table")
    b.add_argument("what", nargs="?", choices=["decode", "fused", "sparse", "latency", "cp"], default="decode",
                   help="decode: the standard shapes; fused: the fused kernels' bandwidth; sparse: the top-k decode; "
                        "latency: batches 1-8, dense and sparse, with targets; cp: context parallel, dense and sparse rows "
                        "(under torchrun every rank's shard timed; snapmla_cute.bench_cp)")
    b.add_argument("--tokens", type=int, nargs="+", default=[1 << 16, 1 << 20, 1 << 22])
    b.add_argument("--page-size", type=int, default=64)
    b.add_argument("--json", help="also write the rows as JSON here")
    b.add_argument("--shape", action="append", metavar="B,H,S_Q,S_K[,varlen]",
                   help="decode shape to time (repeatable); replaces the standard table unless --with-standard")
    b.add_argument("--with-standard", action="store_true", help="time --shape rows after the standard ones")
    b.add_argument("--plot", metavar="PNG", help="write a bar chart of the decode rows")
    b.add_argument("--accurate", action="store_true",
                   help="with decode: also the accurate mode (q_precision e4m3x2) at every row, and its cost in %%")
    b.add_argument("--no-peers", dest="peers", action="store_false",
                   help="decode, sparse, latency: take FlashMLA's figures from the anchors file even where flash_mla runs here")
    b.add_argument("--world", type=int, default=2,
                   help="with cp in one process: the ranks whose shard and merge are projected (under torchrun: the group's size)")
    b.add_argument("--few-heads", action="store_true",
                   help="with sparse (ignored otherwise): the 8- and 16-head rows (tensor-parallel serving) against their floor and the padded h64 path")
    b.set_defaults(func=_bench)
    pr = sub.add_parser("profile", help="Nsight Compute profile of the decode step (one kernel)")
    pr.add_argument("shapes", nargs="*", default=["s1", "s2"],
                    help="s1: b128 h128 s_q1 s_k4096 (memory-bound); s2: b128 h128 s_q2 s_k8192 causal (compute-bound); "
                         "sp128 / sp64 / sp8: the sparse decode at b128 h128 / b64 h64 / b64 h8, topk2048 of 8192")
    pr.add_argument("--out", default="profiles/reports", help="folder for the .ncu-rep reports and text summaries")
    pr.add_argument("--ncu", help="path of the ncu binary (default: found on PATH)")
    pr.add_argument("--summarize", metavar="REPORT", help="only print the summary of an existing .ncu-rep")
    pr.set_defaults(func=_profile)

    lay = sub.add_parser("layouts", help="print (and with --png draw) the decode kernel's layouts")
    lay.add_argument("--rows", type=int, default=8)
    lay.add_argument("--cols", type=int, default=16)
    lay.add_argument("--png", help="write PNG pictures into this folder (needs matplotlib)")
    lay.set_defaults(func=_layouts)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
