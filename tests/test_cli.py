"""`python -m qdispatch` and its subcommands, run as a user would."""
import argparse
import os
import shlex
import subprocess
import sys

import pytest

import qdispatch as qd
from helpers import run_python


def run_module(*args):
    out = run_python("-m", "qdispatch", *args)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_info_prints_version_build_and_backends():
    out = run_module("info")
    assert out.startswith(f"qdispatch {qd.__version__}\n")
    for name in ("reference", "cpu", "cuda"):
        assert f"  {name}" in out
    assert "flags[baseline]" in out


def test_info_names_the_default_backend_or_why_the_variable_cant_set_it():
    """A bad QDISPATCH_BACKEND passed `info` and the demo silently, and surfaced at some
    later call; `info` never said which backend host data goes to."""
    best_host = "cpu" if "cpu" in qd.available_backends() else "reference"
    for value, says in (("", best_host), ("reference", "reference")):
        out = run_python("-m", "qdispatch", "info", QDISPATCH_BACKEND=value)
        assert out.returncode == 0 and f"\ndefault backend: {says}\n" in out.stdout, out.stderr
    out = run_python("-m", "qdispatch", "info", QDISPATCH_BACKEND="bogus")
    assert out.returncode == 0, out.stderr
    assert ("\ndefault backend: none: QDISPATCH_BACKEND='bogus' can't be the default backend: Unknown device "
            "'bogus'") in out.stdout


def test_the_demo_times_each_arm_until_numpys_threads_have_gone_idle(monkeypatch):
    """numpy's BLAS threads spin for a while after its last call, and the demo timed
    the cpu backend's three calls right after numpy's and the reference's: 8-16 ms
    for a 0.35 ms product.  An arm now runs for min_seconds at least, its best call
    reported (a clock that moves only as the calls say, so nothing here is timed)."""
    import time
    from qdispatch import cli
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    took = iter([1.0] + [0.125] * 3 + [0.03125] * 50)  # the warm-up, three slow calls, then fast ones

    def call():
        now[0] += next(took)
        return "out"
    assert cli._measure(call, repeat=3, min_seconds=0.5) == ("out", 0.03125)
    assert len(list(took)) == 46  # four fast calls: 0.375 s + 4 x 0.03125 s = 0.5 s


def test_version():
    assert run_module("--version") == f"qdispatch {qd.__version__}\n"


def test_demo_runs_every_backend_and_shows_the_mismatch():
    out = run_module()
    for backend in qd.available_backends():
        assert f"  {backend:9s} fq" in out and f"  {backend:9s} qq" in out
    assert out.count("SQNR") == 2 * len(qd.available_backends())
    assert "caught BackendMismatchError: q_matmul inputs are on different backends" in out


def test_config_points_at_the_installed_header_and_library():
    flags = run_module("config", "--cflags", "--libs").split()
    include = flags[0][2:]
    assert os.path.exists(os.path.join(include, "qdispatch.h"))
    assert any(f.startswith("-L") and os.path.exists(os.path.join(f[2:], "libqdispatch.so")) for f in flags)
    for libs in (["--libs"], ["--libs", "--static"]):  # link flags alone: no include path among them
        assert not any(f.startswith("-I") for f in run_module("config", *libs).split())
    assert run_module("config") == run_module("config", "--cflags", "--libs")  # neither named: both


def test_config_takes_static_with_cflags_as_pkg_config_does():
    """Build scripts pass --static to every query; the include flag does not change."""
    assert run_module("config", "--cflags", "--static") == run_module("config", "--cflags")
    assert run_module("config", "--static") == run_module("config", "--cflags", "--libs", "--static")


def test_config_pc_is_a_whole_file_given_alone(capsys):
    from qdispatch.__main__ import main
    with pytest.raises(SystemExit) as exc:
        main(["config", "--pc", "--libs"])
    assert exc.value.code == 2 and "--pc prints a whole pkg-config file: give it alone" in capsys.readouterr().err
    text = run_module("config", "--pc")
    assert f"\nVersion: {qd.__version__}\n" in text and "\nLibs: -L${libdir} -Wl,-rpath,${libdir} -lqdispatch\n" in text


@pytest.mark.parametrize("others", [["--libs"], ["--pc"], ["--cflags", "--static"]])
def test_config_cmake_is_a_folder_given_alone(capsys, others):
    from qdispatch.__main__ import main
    with pytest.raises(SystemExit) as exc:
        main(["config", "--cmake", *others])
    assert exc.value.code == 2
    assert f"prints a folder: give it alone (not with {' '.join(others)})" in capsys.readouterr().err
    folder = run_module("config", "--cmake").strip()
    assert folder == qd.get_cmake_dir()
    assert sorted(os.listdir(folder)) == ["qdispatchConfig.cmake", "qdispatchConfigVersion.cmake"]


def test_config_cmake_of_a_build_without_the_package_says_what_to_do(monkeypatch, tmp_path, capsys):
    from qdispatch import cli
    monkeypatch.setattr(qd, "get_cmake_dir", lambda: str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        cli._cmake_dir()
    assert "holds no qdispatchConfig.cmake" in str(exc.value) and "--force-reinstall" in str(exc.value)


def test_config_escapes_a_folder_with_spaces_as_one_word(monkeypatch, capsys):
    """A virtual environment under "My Projects" gave -I/.../My Projects/...: two words
    to make's shell, and the header was not found."""
    from qdispatch import cli
    folder = "/home/me/My Projects/it's $HOME (1)/qdispatch"
    monkeypatch.setattr(qd, "get_include", lambda: folder + "/include")
    monkeypatch.setattr(qd, "get_library_dir", lambda: folder + "/lib")
    cli.config(argparse.Namespace(cflags=True, libs=True, static=False, pc=False, cmake=False))
    words = shlex.split(capsys.readouterr().out)  # as a POSIX shell reads the line (make's recipes, eval)
    assert words == [f"-I{folder}/include", f"-L{folder}/lib", f"-Wl,-rpath,{folder}/lib", "-lqdispatch"]
    cli.config(argparse.Namespace(cflags=False, libs=True, static=True, pc=False, cmake=False))
    assert shlex.split(capsys.readouterr().out)[0] == f"{folder}/lib/libqdispatch.a"


def test_static_link_flags_bring_the_openmp_runtime_the_kernels_were_built_with():
    flags = run_module("config", "--libs", "--static").split()
    assert os.path.exists(flags[0]) and flags[0].endswith("libqdispatch.a")
    assert ("-fopenmp" in flags) == (not qd.info()["build"].get("openmp_left_out"))


def test_info_says_why_a_backend_is_unavailable():
    lines = run_module("info").splitlines()
    for name, entry in qd.info()["backends"].items():
        at = next(i for i, line in enumerate(lines) if line.startswith(f"  {name:9s} "))
        if entry["available"]:
            assert lines[at].startswith(f"  {name:9s} available")
        else:
            assert lines[at].startswith(f"  {name:9s} unavailable") and lines[at + 1].strip() == entry["reason"]


def test_bench_refuses_a_bad_shape_in_one_line():
    out = run_python("-m", "qdispatch", "bench", "--shapes", "1x64x64,3x33x17", "--threads", "1")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == ("shape 3x33x17 can't be run: the int4 path quantizes K in blocks of 32, "
                          "so K=33 must be a multiple of 32 (or leave int4 out of --paths)\n")


def test_a_bad_default_backend_names_its_environment_variable():
    code = "import numpy as np, qdispatch as qd; qd.quantize(np.ones((2, 4), np.float32))"
    out = run_python("-c", code, QDISPATCH_BACKEND="gpu")
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1] == (
        f"qdispatch.errors.ArgumentError: QDISPATCH_BACKEND='gpu' can't be the default backend: Unknown device "
        f"'gpu': expected 'reference', 'cpu', 'cuda' or 'cuda:N' (available here: "
        f"{', '.join(qd.available_backends())}; "
        f"set the variable to one of them, or unset it)")


def test_the_installed_command_runs_the_installed_package_from_the_source_tree():
    """The README's demo command, `pip install . && qdispatch`, runs where `python -m`
    would import the source tree's package, which has no compiled modules."""
    command = os.path.join(os.path.dirname(sys.executable), "qdispatch")
    if not os.path.isfile(command):
        pytest.skip("no installed qdispatch command beside this python (a package built in place)")
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([command, "info"], cwd=root, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"qdispatch {qd.__version__}\n")


def test_a_subcommands_unknown_option_gets_its_own_usage(capsys):
    """`qdispatch bench --frob` printed the top-level usage, which lists no bench options."""
    from qdispatch.__main__ import main
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--frob"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "usage: qdispatch bench" in err and "unrecognized arguments: --frob" in err



def test_an_interrupt_ends_the_command_with_a_word(monkeypatch, capsys):
    """Ctrl-C in a long `qdispatch bench` printed a KeyboardInterrupt traceback."""
    from qdispatch import __main__, cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "info", interrupted)
    monkeypatch.setattr(sys, "argv", ["qdispatch", "info"])
    assert __main__.run() == 130
    assert capsys.readouterr().err == "qdispatch: interrupted; nothing further was written\n"


def test_a_warning_is_a_line_of_the_commands_own(monkeypatch, capsys):
    """bench's warnings came as Python shows them: a file, a line number, the category
    and the line of source that warned, for each case."""
    import warnings
    from qdispatch import __main__, cli
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # the command sets its own

    def warns(args):
        warnings.warn("its weights rotate through 1.0 MiB", UserWarning)
    monkeypatch.setattr(cli, "info", warns)
    monkeypatch.setattr(sys, "argv", ["qdispatch", "info"])
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert __main__.run() == 0
    assert capsys.readouterr().err == "qdispatch: warning: its weights rotate through 1.0 MiB\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_an_output_that_cant_be_written_ends_the_command_with_a_word():
    """`qdispatch info > /dev/full` ended in an OSError traceback."""
    with open("/dev/full", "w") as full:
        out = run_python("-m", "qdispatch", "info", stdout=full)
    assert out.returncode == 1 and out.stderr == "qdispatch: can't write the output: No space left on device\n"


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """`qdispatch info | head -1`: a closed pipe is no error worth a word."""
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as closed:
        out = run_python("-m", "qdispatch", "info", stdout=closed)
    assert out.returncode == 1 and out.stderr == ""
