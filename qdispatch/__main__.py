"""`qdispatch [demo|info|config|bench]`, or `python -m qdispatch ...`."""
import argparse
import errno
import os
import sys
import warnings

from . import cli


def main(argv=None):
    parser = argparse.ArgumentParser(prog="qdispatch",
                                     description="qdispatch: quantized tensors that know their backend")
    parser.add_argument("--version", action="version", version=f"qdispatch {cli.qd.__version__}")
    sub = parser.add_subparsers(dest="command")
    commands = {
        "demo": sub.add_parser("demo", help="quantize a 4096 x 4096 layer and multiply on every backend (default)"),
        "info": sub.add_parser("info", help="print the version, build and backends"),
        "config": sub.add_parser("config", help="compiler flags for C programs that embed the kernels "
                                                "(both kinds when neither --cflags nor --libs is given)"),
        "bench": sub.add_parser("bench", help="benchmark the kernels against numpy float32"),
    }
    commands["config"].add_argument("--cflags", action="store_true", help="the flags that find qdispatch.h")
    commands["config"].add_argument("--libs", action="store_true", help="the flags that link libqdispatch")
    commands["config"].add_argument("--pc", action="store_true",
                                    help="a pkg-config file for this install (for CMake's or Meson's pkg-config "
                                         "lookup): write it to a folder on PKG_CONFIG_PATH as qdispatch.pc")
    commands["config"].add_argument("--cmake", action="store_true",
                                    help="the folder of qdispatch's CMake package: qdispatch_DIR for "
                                         "find_package(qdispatch), whose targets are qdispatch::qdispatch and "
                                         "qdispatch::qdispatch_static")
    commands["config"].add_argument("--static", action="store_true",
                                    help="link libqdispatch.a instead of the .so (the --cflags are the same)")
    cli.add_bench_arguments(commands["bench"])
    # an unknown option is the subcommand's to refuse, with its own usage
    args, unknown = parser.parse_known_args(argv)
    command = args.command or "demo"
    if unknown:
        (commands[command] if args.command else parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if command == "config":
        for whole, what in (("cmake", "a folder"), ("pc", "a whole pkg-config file")):
            others = [f"--{name}" for name in ("cflags", "libs", "static", "pc", "cmake")
                      if name != whole and getattr(args, name)]
            if getattr(args, whole) and others:
                commands["config"].error(f"--{whole} prints {what}: give it alone (not with {' '.join(others)})")
    return getattr(cli, command)(args) or 0


def _warning_line(message, category, filename, lineno, file=None, line=None):
    """A warning as the command's own line, not Python's (its file, line and source)."""
    print(f"qdispatch: warning: {message}", file=sys.stderr if file is None else file)


def run():
    """The console script: main(), an interrupt (Ctrl-C) or an output that can't be
    written ending it with a word, not a traceback, and warnings as lines of its own."""
    warnings.showwarning = _warning_line
    try:
        status = main()
        sys.stdout.flush()  # here, where a failure is caught, not at exit
        return status
    except KeyboardInterrupt:
        print("qdispatch: interrupted; nothing further was written", file=sys.stderr)
        return 130  # as a shell reports SIGINT
    except OSError as exc:
        if exc.errno not in (errno.EPIPE, errno.ENOSPC):
            raise
        # the output can't be written (a reader that stopped early, a full disk): the rest
        # goes to the null device, so that Python's flush at exit meets no error again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if exc.errno != errno.EPIPE:  # `| head` stopping early needs no word
            print(f"qdispatch: can't write the output: {exc.strerror}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(run())
