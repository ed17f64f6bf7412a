"""`qdispatch [demo|info|config|bench]`, or `python -m qdispatch ...`."""
import argparse
import sys

from . import cli


def main(argv=None):
    parser = argparse.ArgumentParser(prog="qdispatch",
                                     description="qdispatch: quantized tensors that know their backend")
    parser.add_argument("--version", action="version", version=f"qdispatch {cli.qd.__version__}")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("demo", help="quantize a 4096 x 4096 layer and multiply on every backend (default)")
    sub.add_parser("info", help="print the version, build and backends")
    config = sub.add_parser("config", help="compiler flags for C programs that embed the kernels")
    config.add_argument("--cflags", action="store_true")
    config.add_argument("--libs", action="store_true")
    config.add_argument("--static", action="store_true", help="link libqdispatch.a instead of the .so")
    bench = sub.add_parser("bench", help="benchmark the kernels against numpy float32")
    cli.add_bench_arguments(bench)
    args = parser.parse_args(argv)
    command = args.command or "demo"
    return getattr(cli, command)(args) or 0


if __name__ == "__main__":
    sys.exit(main())
