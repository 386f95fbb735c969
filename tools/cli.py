"""The `outcore` command line: parse, call an importable function, print. No logic lives here."""

from __future__ import annotations

import argparse
import logging
import sys

from tools.units import human_bytes, parse_list, parse_size

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A user mistake: printed as one line, exit status 2."""


def _sizes(text: str) -> list[int]:
    return parse_list(text, parse_size)


def _ints(text: str) -> list[int]:
    return parse_list(text, int)


def _words(text: str) -> list[str]:
    return parse_list(text, str.strip)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="outcore", description="Offload-first, out-of-core training for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bench-disk", help="read/write throughput of a directory per I/O setting")
    b.add_argument("--dir", required=True, help="directory on the disk to measure")
    b.add_argument("--size", type=parse_size, default=parse_size("4G"), help="file size (default 4G)")
    b.add_argument("--block-size", type=_sizes, default=_sizes("128K,1M,8M"))
    b.add_argument("--queue-depth", type=_ints, default=_ints("1,8,32"))
    b.add_argument("--threads", type=_ints, default=_ints("1,2,4"))
    b.add_argument("--direct", action=argparse.BooleanOptionalAction, default=True)
    b.add_argument("--backend", type=_words, default=_words("threads,aiofiles"))
    b.add_argument("--repeats", type=int, default=1, help="interleaved runs per setting; medians reported")
    b.add_argument("--no-fio", action="store_true", help="skip the fio reference even if fio is on PATH")
    b.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    b.set_defaults(run=_bench_disk)

    for name, what in (("train", "train a GPT on a text file or the built-in corpus"),
                       ("tune", "sweep prefetch and I/O settings on the real model"),
                       ("estimate", "per-tier bytes per rank for a model size"),
                       ("export", "consolidate a sharded checkpoint into safetensors")):
        s = sub.add_parser(name, help=what)
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(run=_not_built, name=name)
    return p


def _bench_disk(args: argparse.Namespace) -> int:
    from tools.bench_disk import bench_disk
    from tools.report import progress, table, write_json

    settings = len(args.block_size) * len(args.queue_depth) * len(args.threads) * len(args.backend)
    with progress(args.repeats * settings, "bench-disk") as bar:
        try:
            res = bench_disk(args.dir, size=args.size, block_sizes=args.block_size, queue_depths=args.queue_depth,
                             threads=args.threads, backends=args.backend, direct=args.direct,
                             repeats=args.repeats, use_fio=not args.no_fio, progress=bar)
        except ValueError as e:
            raise UsageError(str(e)) from None
    fio = res["use_fio"]
    headers = ["backend", "direct", "block", "qd", "thr", "write MB/s", "read MB/s"]
    headers += ["fio write", "fio read", "w ratio", "r ratio"] if fio else []
    rows = []
    for i, r in enumerate(res["results"]):
        w_mark = "*" if res["best_write"] == i else " "
        r_mark = "*" if res["best_read"] == i else " "
        row = [r["backend"], "yes" if r["direct_used"] else "no", human_bytes(r["block_size"]), r["queue_depth"],
               r["threads"], f"{r['write_MBps']:,.0f}{w_mark}", f"{r['read_MBps']:,.0f}{r_mark}"]
        if fio:
            row += [f"{r['fio_write_MBps']:,.0f}", f"{r['fio_read_MBps']:,.0f}",
                    f"{r['write_ratio']:.2f}", f"{r['read_ratio']:.2f}"]
        rows.append(row)
    print(f"{human_bytes(res['size'])} file in {res['directory']}, median of {res['repeats']} run(s); * = best")
    table(headers, rows)
    if fio:
        print("\nratios are medians of ours / fio run back to back (libaio, same block size and queue depth)")
        print("best per block size, ours vs fio's best (and the best paired ratio):")
        table(["block", "write MB/s", "fio", "ratio", "paired", "read MB/s", "fio", "ratio", "paired"],
              [[human_bytes(bs), f"{v['ours_write_MBps']:,.0f}", f"{v['fio_write_MBps']:,.0f}",
                f"{v['write_ratio']:.2f}", f"{v['write_ratio_paired']:.2f}", f"{v['ours_read_MBps']:,.0f}",
                f"{v['fio_read_MBps']:,.0f}", f"{v['read_ratio']:.2f}", f"{v['read_ratio_paired']:.2f}"]
               for bs, v in res["by_block_size"].items()])
    else:
        why = "--no-fio was given" if args.no_fio else "fio is not on PATH"
        print(f"\n(no fio reference figures: {why})")
    if not res["cache_dropped"]:
        print("note: could not drop the global page cache (needs root); the file itself was evicted with fadvise")
    slots = human_bytes(res["largest_host_buffers_bytes"])
    print(f"peak RSS {human_bytes(res['peak_rss_bytes'])} (largest I/O slots {slots})")
    write_json(args.json, res)
    return EXIT_OK


def _not_built(args: argparse.Namespace) -> int:
    print(f"outcore {args.name}: not built yet — it needs the ZeRO engine (runtime/), which has not landed. "
          "`outcore bench-disk` works today.", file=sys.stderr)
    return EXIT_RUNTIME


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="outcore: %(message)s")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except ValueError as e:
        print(f"outcore: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.run(args)
    except UsageError as e:
        print(f"outcore: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # noqa: BLE001 - a runtime failure: its cause, not a traceback
        print(f"outcore {args.command}: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
