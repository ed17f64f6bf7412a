"""Every benchmark runs once on a tiny shape; the bench command writes its JSON
and explains a missing matplotlib.  No timing is asserted anywhere."""
import argparse
import builtins
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import qdispatch
from helpers import built_with_openmp
from qdispatch import bench

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
TINY = bench.Shape(2, 64, 48)


def _run(args, cwd, **settings):
    """`python args` in `cwd`, importing the same qdispatch as this test (installed or built in place),
    with environment `settings` added."""
    env = {**os.environ, **settings}
    here = os.path.dirname(os.path.dirname(qdispatch.__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable] + args, cwd=cwd, env=env, capture_output=True, text=True)


@pytest.mark.parametrize("case", list(bench.plan([TINY], bench.PATHS, ["cpu"], [1])), ids=lambda c: c.id)
def test_every_case_runs_once(case):
    """Each case computes its path's result on both weight copies, as bench's own
    check finds it (build checked the first copy already): float32 out, or for
    int_matmul int32."""
    reason = case.skip_reason()
    if reason:
        pytest.skip(reason)
    with bench.thread_limit(1), pytest.warns(UserWarning, match="less than 16x the last-level cache"):
        b = bench.build(case, copies=2)
        out, again = b.fn(), b.fn()  # both weight copies, each a fresh result
    for copy, result in enumerate((out, again)):
        bench.check_result(case, result, copy=copy)
    if case.path != "quantize":
        exact_ints = case.path == "int_matmul" and case.impl != "numpy_f32"
        assert bench._as_array(out).dtype == (np.int32 if exact_ints else np.float32)


def _one_ulp_off(out):
    """One output nudged by the least step: the bit-for-bit checks must see it."""
    out = bench._as_array(out).copy()
    last = out[-1, -1]  # inf of its own type: numpy 1.x took a float64 step from a Python float
    out[-1, -1] = np.nextafter(last, out.dtype.type(np.inf)) if out.dtype.kind == "f" else last + 1
    return out


def _one_percent_off(out):
    """Every output 1% off: past float32 rounding (1e-5 of sum |x||w|) by far."""
    return bench._as_array(out) * np.float32(1.01)


def _half_again(out):
    """Every output 1.5 times itself: past the rounding noise of activations quantized per tensor."""
    return bench._as_array(out) * np.float32(1.5)


@pytest.mark.parametrize("path,impl,corrupt", [
    ("qq_int8", "cpu", _one_ulp_off), ("qq_int4", "cpu", _one_ulp_off), ("w8a8", "cpu", _one_ulp_off),
    ("int_matmul", "cpu", _one_ulp_off), ("int_matmul", "ort_int_s8s8", _one_ulp_off),
    ("fq_int8", "cpu", _one_percent_off), ("int4", "cpu", _one_percent_off), ("qq_int8", "numpy_f32", _one_percent_off),
    ("qq_int8", "ort_qq_u8u8", _one_percent_off), ("w8a8", "ort_w8a8", _half_again), ("w8a8", "fbgemm", _half_again),
])
def test_a_wrong_result_fails_the_case_naming_it(monkeypatch, path, impl, corrupt):
    """A corrupted output raises before anything is timed, naming the case, its contender and the error."""
    case = bench.Case(TINY, path, impl, 1)
    if case.skip_reason():
        pytest.skip(case.skip_reason())
    builders, key = (bench._CONTENDER_BUILDERS, impl) if case.is_contender else (bench._PATH_BUILDERS, path)
    real = builders[key]

    def build_corrupted(case, x, w):
        fn, nbytes = real(case, x, w)
        return (lambda: corrupt(fn())), nbytes
    monkeypatch.setitem(builders, key, build_corrupted)
    with pytest.raises(bench.WrongResultError, match=rf"^{case.id}: {impl} gave a wrong output: .* \(error .*, "
                                                      rf"tolerance .*\); expected: "):
        bench.build(case, copies=1)


@pytest.mark.parametrize("row", [1, 7, 14])
def test_a_wrong_row_of_a_decode_batch_is_caught(monkeypatch, row):
    """Eight sampled rows of 16 left rows 1, 3, 5, 7, 8, 10, 12 and 14 unchecked."""
    case = bench.Case(bench.Shape(16, 64, 48), "qq_int8", "cpu", 1)
    real = bench._PATH_BUILDERS["qq_int8"]

    def build_corrupted(case, x, w):
        fn, nbytes = real(case, x, w)

        def wrong_row():
            out = bench._as_array(fn()).copy()
            out[row] = 0
            return out
        return wrong_row, nbytes
    monkeypatch.setitem(bench._PATH_BUILDERS, "qq_int8", build_corrupted)
    with pytest.raises(bench.WrongResultError, match=rf"^{case.id}: cpu gave a wrong output"):
        bench.build(case, copies=1)


def test_a_wrong_result_on_any_weight_copy_fails_the_case(monkeypatch):
    """Only the first copy's first call was checked: a product wrong on the other
    copies (a packing that goes wrong past the first weight) was timed unseen."""
    case = bench.Case(TINY, "qq_int8", "cpu", 1)
    real, built = bench._PATH_BUILDERS["qq_int8"], []

    def third_copy_wrong(case, x, w):
        fn, nbytes = real(case, x, w)
        built.append(w)
        return ((lambda: _one_ulp_off(fn())) if len(built) == 3 else fn), nbytes
    monkeypatch.setitem(bench._PATH_BUILDERS, "qq_int8", third_copy_wrong)
    with pytest.raises(bench.WrongResultError, match=rf"^{case.id}: cpu gave a wrong output"):
        bench.build(case, copies=4)
    assert len(built) == 3  # it stopped at the wrong copy
    built.clear()
    monkeypatch.setitem(bench._PATH_BUILDERS, "qq_int8", real)
    with pytest.warns(UserWarning, match="less than 16x"):
        assert bench.build(case, copies=4).copies == 4  # the right products pass, every copy checked


def test_a_wrong_result_stops_the_bench_command(monkeypatch, capsys):
    """The command reports no figures for a run that timed a wrong product, and exits non-zero."""
    from qdispatch.__main__ import main
    monkeypatch.setitem(bench._CONTENDER_BUILDERS, "numpy_f32",
                        lambda case, x, w: ((lambda: np.zeros((case.shape.m, case.shape.n), np.float32)), w.nbytes))
    with pytest.raises(SystemExit, match=r"^wrong result, nothing reported: 2x64x64-qq_int8-numpy_f32-t1: numpy_f32 "
                                         r"gave a wrong output"):
        main(["bench", "--shapes", "2x64x64", "--threads", "1", "--paths", "qq_int8", "--repeat", "1",
              "--bandwidth-mb", "1", "--rotation-mb", "1"])
    assert "GOP/s" not in capsys.readouterr().out


def test_a_quantized_contender_is_held_to_its_noise_per_output():
    """fbgemm's 7-bit activations: the float product passes, and so does its worst
    noise, but not an output moved by 20 of its noise's standard deviations."""
    case = bench.Case(bench.Shape(4, 512, 64), "w8a8", "fbgemm", 1)
    expected = bench.expected_results(case)[0][1]
    x, w = bench.operands(case.shape)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    bench.assert_matches(case, "output", exact, expected)
    sigma = (expected.tolerance - bench.FLOAT_RTOL * (np.abs(x) @ np.abs(w).T)) / bench.NOISE_SIGMAS
    bench.assert_matches(case, "output", exact + 5 * sigma, expected)
    moved = exact.copy()
    moved[1, 7] += 20 * sigma[1, 7]
    with pytest.raises(bench.WrongResultError, match=r"fbgemm gave a wrong output: 1 of 256 .* at \(1, 7\)"):
        bench.assert_matches(case, "output", moved, expected)
    moved[1, 7] = np.nan  # within no tolerance, though no comparison with it is true
    with pytest.raises(bench.WrongResultError, match=r"fbgemm gave a wrong output: 1 of 256 .* at \(1, 7\): nan"):
        bench.assert_matches(case, "output", moved, expected)


@pytest.mark.parametrize("text", ["0x64x64", "1x0x64", "1x64x0", "-1x64x64"])
def test_a_shape_with_no_values_is_refused(text):
    with pytest.raises(ValueError, match=r"has a dimension <= 0"):
        bench.Shape.parse(text)


def test_each_contender_does_its_paths_job():
    """FBGEMM quantizes activations inside the call: W8A8 only, not the
    pre-quantized qq path nor the weight-only fq path."""
    assert [p for p, names in bench.PATH_CONTENDERS.items() if "fbgemm" in names] == ["w8a8"]
    assert all(names[0] == "numpy_f32" for names in bench.PATH_CONTENDERS.values())
    listed = {name for names in bench.PATH_CONTENDERS.values() for name in names}
    assert listed == set(bench.CONTENDERS)


def test_rotated_copies_hold_different_weights():
    with pytest.warns(UserWarning, match="less than 16x the last-level cache"):
        b = bench.build(bench.Case(TINY, "fq_int8", "cpu", 1), copies=2)
    assert b.copies == 2
    assert not np.array_equal(b.fn().numpy(), b.fn().numpy())


def test_weight_copies_exceed_16x_the_cache_within_the_budget(monkeypatch):
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: 200 << 20)
    int4_4096 = 4096 * 4096 // 2
    copies = bench.weight_copies(int4_4096, budget_bytes=4 << 30)
    assert copies * int4_4096 >= 16 * (200 << 20) > (copies - 1) * int4_4096
    assert bench.weight_copies(int4_4096, budget_bytes=100 << 20) == 12
    assert bench.weight_copies(int4_4096, budget_bytes=4 << 30, max_copies=16) == 16


def test_a_rotation_short_of_the_cache_says_so(monkeypatch):
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: 1 << 30)
    with pytest.warns(UserWarning, match=r"fq_int8-cpu-t1: its weights rotate through .* MiB \(1 copies\)"):
        b = bench.build(bench.Case(TINY, "fq_int8", "cpu", 1), budget_bytes=TINY.n * TINY.k)
    assert not b.defeats_cache and b.rotated_bytes == b.weight_bytes


def _benchmark_module(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Untimed:
    """pytest-benchmark's fixture under --benchmark-disable: one call, no stats."""
    group = stats = None

    def __call__(self, fn):
        fn()


@pytest.mark.parametrize("impl", ["cpu", "reference", "float_lookup"])
def test_lookup_benchmark_keeps_its_copies_within_the_rotation_budget(monkeypatch, impl):
    """Past a large cache, the copies that defeat it would be a million tiny tables:
    --bench-rotation-mb caps them, as it caps every other benchmark's."""
    lookup = _benchmark_module("bench_lookup")
    budget = 1 << 20
    table = np.zeros((TINY.n, TINY.k), np.float32)
    nbytes = table.nbytes if impl == "float_lookup" else qdispatch.quantize(table, bench.W8, device=impl).nbytes
    copies = []
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: 1 << 40)
    monkeypatch.setattr(bench, "default_rotation_budget", lambda: 16 * budget)  # what a budget ignored gives
    if impl == "float_lookup":
        made = lookup._float_lookups
        monkeypatch.setattr(lookup, "_float_lookups", lambda tables, ids: copies.extend(tables) or made(tables, ids))
    else:
        quantize = qdispatch.quantize
        monkeypatch.setattr(qdispatch, "quantize", lambda *a, **kw: copies.append(1) or quantize(*a, **kw))
    with pytest.warns(UserWarning, match=r"int8 per row: its weights rotate through 1\.0 MiB"):
        lookup.test_lookup(_Untimed(), TINY, "int8 per row", impl, budget)
    assert len(copies) == budget // nbytes


def test_lookup_benchmark_checks_every_copys_rows(monkeypatch):
    """It timed whatever qd.embedding returned."""
    lookup = _benchmark_module("bench_lookup")
    embedding, calls = qdispatch.embedding, []

    def third_copy_off(ids, q):
        calls.append(1)
        rows = embedding(ids, q).numpy()
        return rows if len(calls) != 3 else np.nextafter(rows, np.inf)
    monkeypatch.setattr(qdispatch, "embedding", third_copy_off)
    with pytest.warns(UserWarning), pytest.raises(AssertionError, match=r"qd.embedding on cpu, copy 2: the lookup's "
                                                                        r"rows differ from the reference's"):
        lookup.test_lookup(_Untimed(), TINY, "int4 block 32", "cpu", 1 << 16)


def test_isa_benchmark_builds_a_case_once_and_checks_every_copy_on_each_isa(monkeypatch):
    """Each ISA quantized its own hundreds of weight copies (most of the run's time on a
    large-cache host); the copies are now shared, so each ISA must check them itself."""
    isa_bench = _benchmark_module("bench_isa")
    isas = isa_bench._runnable_isas()
    if not isas:
        pytest.skip("no SIMD ISA runs here")
    case = bench.Case(TINY, "qq_int8", "cpu", 1)
    build, builds = bench.build, []
    monkeypatch.setattr(bench, "build", lambda case, **kw: builds.append(case.id) or build(case, copies=3))
    with pytest.warns(UserWarning, match="less than 16x"):
        for isa in isas:
            isa_bench.test_isa(_Untimed(), (case, isa), 1 << 20)
    assert builds == [case.id]
    copies, wrong_on = isa_bench._built(case, 1 << 20).calls, isas[-1]
    right = copies[2]
    copies[2] = lambda: _one_ulp_off(right()) if qdispatch.info()["backends"]["cpu"]["isa"] == wrong_on else right()
    for isa in isas[:-1]:
        isa_bench.test_isa(_Untimed(), (case, isa), 1 << 20)
    with pytest.raises(bench.WrongResultError, match=rf"^{case.id}: cpu gave a wrong output"):
        isa_bench.test_isa(_Untimed(), (case, wrong_on), 1 << 20)
    assert builds == [case.id]


def test_ceilings_run():
    with pytest.warns(UserWarning, match="it measures the cache, not memory"):
        c = bench.ceilings(threads=1, repeat=1, bandwidth_bytes=1 << 20)
    assert c["read_gbs"] > 0 and c["int8_peak_gops"] > 0
    assert c["read_buffer_bytes"] == 1 << 20 and not c["read_buffer_defeats_cache"]
    assert c["int8_peak_gops"] == max(c["peak_gops_per_shape"].values())


def test_bandwidth_buffer_exceeds_the_cache_by_default():
    assert bench.exceeds_cache(bench.default_bandwidth_bytes())


def test_streaming_read_reads_on_every_thread():
    with pytest.warns(UserWarning), bench.streaming_read(3 << 10, threads=3) as (fn, nbytes):
        assert fn() == [1, 1, 1] and nbytes == 3 << 10


def test_bench_command_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(["-m", "qdispatch", "bench", "--shapes", "2x64x64", "--threads", "1", "--repeat", "1",
                 "--bandwidth-mb", "1", "--rotation-mb", "1", "--json", str(out)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "GOP/s" in proc.stdout and "done" in proc.stderr
    data = json.loads(out.read_text())
    assert data["machine"]["qdispatch"] and data["machine"]["cores"] >= 1
    assert data["machine"]["isa"]
    assert data["machine"]["cpu_openmp"] == built_with_openmp()
    assert ("built without OpenMP" in proc.stdout) != built_with_openmp()
    paths = {(r["path"], r["impl"]) for r in data["results"]}
    assert {(p, "cpu") for p in bench.PATHS} <= paths
    assert ("qq_int8", "numpy_f32") in paths
    assert all(r["ratio_numpy_f32"] for r in data["results"])
    assert all(r["rotated_bytes"] == r["weight_bytes"] * r["weight_copies"] for r in data["results"])
    assert all(r["rotation_defeats_cache"] is False for r in data["results"])  # a 1 MiB budget
    assert "less than 16x the last-level cache" in proc.stderr
    assert data["ceilings"][0]["threads"] == 1
    assert "streaming read" in proc.stdout and "qq int8 peak" in proc.stdout


def test_a_json_file_that_cant_be_written_is_left_as_it_was(monkeypatch, tmp_path):
    """The results were written in place: a full disk at the end of a run left a cut,
    invalid file where the old results had been, and a traceback."""
    from qdispatch.__main__ import main
    out = tmp_path / "bench.json"
    out.write_text('{"old": 1}')

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", full_disk)
    args = ["bench", "--shapes", "2x64x64", "--threads", "1", "--paths", "quantize", "--repeat", "1",
            "--bandwidth-mb", "1", "--rotation-mb", "1", "--json"]
    with pytest.raises(SystemExit, match=r"--json .*bench\.json: the results could not be written \(No space "
                                         r"left on device\); the file is as it was"):
        main(args + [str(out)])
    assert out.read_text() == '{"old": 1}' and os.listdir(tmp_path) == ["bench.json"]
    monkeypatch.undo()
    assert main(args + [os.devnull]) == 0  # not a regular file: written in place, never replaced
    assert not os.path.isfile(os.devnull)


def test_no_usable_host_backend_is_refused_before_anything_runs(tmp_path):
    """With the cpu backend unusable the default backend list was empty: the command
    timed numpy alone and exited 0."""
    proc = _run(["-m", "qdispatch", "bench", "--shapes", "2x64x64", "--threads", "1"], cwd=tmp_path,
                QDISPATCH_ISA="bogus")
    assert proc.returncode == 1 and "GOP/s" not in proc.stdout
    assert "no qdispatch host backend to time: the cpu backend can't run here (QDISPATCH_ISA=bogus" in proc.stderr
    assert "--backend reference" in proc.stderr


def _operands_past_memory_at_three_rows(monkeypatch):
    """Shapes of M = 3 raise MemoryError when their operands are made, as past the free memory."""
    real = bench.operands

    def operands(shape):
        if shape.m == 3:
            raise MemoryError("Unable to allocate 37.3 GiB")
        return real(shape)
    monkeypatch.setattr(bench, "operands", operands)


def test_a_plot_of_nothing_measured_is_not_drawn(monkeypatch, capsys):
    """With every case skipped, --plot raised matplotlib's ValueError before the
    command could say that nothing was measured."""
    from qdispatch.__main__ import main
    monkeypatch.setattr(bench, "require_matplotlib", lambda: None)
    monkeypatch.setattr(bench, "plot", lambda rows, out: pytest.fail("plotted no rows"))
    _operands_past_memory_at_three_rows(monkeypatch)
    assert main(["bench", "--shapes", "3x64x64", "--threads", "1", "--paths", "qq_int8", "--repeat", "1",
                 "--bandwidth-mb", "1", "--rotation-mb", "1", "--plot", "nothing.png"]) == 1
    assert "nothing was measured: every case was skipped" in capsys.readouterr().err


def test_bench_leaves_cuda_to_its_own_benchmarks(monkeypatch):
    """Its timing (perf_counter, CPU-cache-sized rotation) is wrong for a GPU."""
    from qdispatch.__main__ import main
    monkeypatch.setattr(qdispatch, "available_backends", lambda: ["reference", "cpu", "cuda"])
    with pytest.raises(SystemExit, match=r"can't time cuda: .*benchmarks/bench_cuda\.py"):
        main(["bench", "--backend", "cpu,cuda", "--shapes", "2x64x64", "--threads", "1"])
    assert "bench_cuda.py" in bench.Case(TINY, "qq_int8", "cuda", 1).skip_reason()


def test_pytest_benchmarks_run_once(tmp_path):
    pytest.importorskip("pytest_benchmark")
    # fbgemm's cases are left to test_every_case_runs_once: importing torch again takes seconds.
    # The cuda benchmarks run at their full sizes (minutes): the cuda run covers them.
    proc = _run(["-m", "pytest", BENCHMARKS, "-q", "-p", "no:cacheprovider", "--benchmark-disable",
                 "--bench-shapes", "2x64x64", "--bench-threads", "1", "--bench-bandwidth-mb", "1",
                 "--bench-rotation-mb", "1", "-k", "not fbgemm", "-m", "not cuda",
                 f"--basetemp={tmp_path / 'basetemp'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout


def test_a_benchmark_file_named_alone_is_collected_once(tmp_path):
    """`pytest benchmarks/bench_cpu.py` (as its docstring says to run it) collects each case once."""
    def collected(path):
        proc = _run(["-m", "pytest", path, "--collect-only", "-q", "-p", "no:cacheprovider",
                     "--bench-shapes", "2x64x64", "--bench-threads", "1"], cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [line for line in proc.stdout.splitlines() if "::" in line]
    alone = collected(os.path.join(BENCHMARKS, "bench_cpu.py"))
    assert alone and len(alone) == len(set(alone))
    assert sorted(alone) == sorted(line for line in collected(BENCHMARKS) if "bench_cpu.py::" in line)


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys):
    real_import = builtins.__import__

    def blocked(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", blocked)
    from qdispatch.__main__ import main
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--shapes", "2x64x64", "--threads", "1", "--plot", "out.png"])
    assert "pip install" in str(exc.value) and "matplotlib" in str(exc.value)


def test_bad_arguments_are_clear():
    from qdispatch.__main__ import main
    with pytest.raises(SystemExit, match="unknown path"):
        main(["bench", "--paths", "qq_int9"])


def test_count_takes_whole_numbers_from_one():
    """The parser of --repeat, --bandwidth-mb and --rotation-mb on its own: a count it let
    through would start a full run in the test below, not fail it."""
    assert bench.count("1") == 1 and bench.count("12") == 12
    for text in ("0", "-2", "1.5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="is no count: give a whole number of at least 1"):
            bench.count(text)


@pytest.mark.parametrize("option,value,message", [
    ("--threads", "1,0", "argument --threads: 0 is no count: give a whole number of at least 1"),
    ("--threads", "-1", "argument --threads: -1 is no count"),
    ("--repeat", "0", "argument --repeat: 0 is no count"),
    ("--bandwidth-mb", "-1", "argument --bandwidth-mb: -1 is no count"),
    ("--repeat", "x", "argument --repeat: 'x' is no count: give a whole number of at least 1"),
    ("--threads", "abc", "argument --threads: 'abc' is no count"),
    ("--threads", "100000", "argument --threads: 100000 threads: the kernels run at most"),
    ("--shapes", ",", "argument --shapes: ',' names nothing: give a comma-separated list"),
    ("--threads", "", "argument --threads: '' names nothing"),
    ("--paths", ",", "argument --paths: ',' names nothing"),
    ("--shapes", "99999999999999999999x32x32", "argument --shapes: shape '99999999999999999999x32x32' has a "
                                               "float32 operand past 256 TiB"),
    ("--shapes", "4000000000x4000000000x1", "has a float32 operand past 256 TiB"),  # numpy's ValueError once
])
def test_counts_below_one_are_refused(capsys, option, value, message):
    """--repeat 0, --threads 0 or --bandwidth-mb -1 ran, labelled rows "0" and
    measured a 16 KiB buffer as the read bandwidth."""
    from qdispatch.__main__ import main
    with pytest.raises(SystemExit) as exc:
        main(["bench", option, value])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def refuse_to_run(*args):
    raise AssertionError("a case ran before every argument was checked")


def test_a_shape_a_path_cant_run_is_refused_before_anything_runs(monkeypatch):
    from qdispatch.__main__ import main
    monkeypatch.setattr(bench, "_run_cases", refuse_to_run)
    with pytest.raises(SystemExit, match=r"^shape 3x33x17 can't be run: the int4 path quantizes K in blocks of 32, "
                                         r"so K=33 must be a multiple of 32 \(or leave int4 out of --paths\)$"):
        main(["bench", "--shapes", "1x64x64,3x33x17", "--threads", "1"])
    assert bench.Shape(3, 33, 17).problem("qq_int8") is None
    assert bench.Shape(3, 64, 17).problem("int4") is None


def test_an_output_that_cant_be_written_is_refused_before_anything_runs(monkeypatch, tmp_path):
    from qdispatch.__main__ import main
    monkeypatch.setattr(bench, "_run_cases", refuse_to_run)
    missing = tmp_path / "no such folder" / "bench.json"
    with pytest.raises(SystemExit, match=r"^--json .*bench\.json: folder .*no such folder does not exist; create it"):
        main(["bench", "--shapes", "2x64x64", "--threads", "1", "--json", str(missing)])
    with pytest.raises(SystemExit, match=r"^--plot .*: can't write there \(Is a directory\); choose another path$"):
        main(["bench", "--shapes", "2x64x64", "--threads", "1", "--plot", str(tmp_path)])
    if os.path.isdir("/proc/self"):  # os.access says yes there (and to root anywhere): the run failed at its end
        with pytest.raises(SystemExit, match=r"^--json /proc/bench\.json: can't write there \("):
            main(["bench", "--shapes", "2x64x64", "--threads", "1", "--json", "/proc/bench.json"])
    with pytest.raises(SystemExit, match=r"^--json '': that names no file"):  # once ignored: nothing written
        main(["bench", "--shapes", "2x64x64", "--threads", "1", "--json", ""])
    kept = tmp_path / "kept.json"
    main_args = ["bench", "--shapes", "2x64x64", "--threads", "1", "--json", str(kept)]
    with pytest.raises(AssertionError, match="a case ran"):  # the check leaves no file behind
        main(main_args)
    assert not kept.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_pipe_for_the_results_is_written_once_at_the_end(tmp_path):
    """The check that --json can be written opened and closed the pipe: with no reader
    it waited forever, and a reader took the close as the end and got nothing."""
    import threading
    fifo = str(tmp_path / "results")
    os.mkfifo(fifo)
    checker = threading.Thread(target=bench._check_writable, args=("--json", fifo), daemon=True)
    checker.start()
    checker.join(10)
    assert not checker.is_alive(), "the check waited for a reader"
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()), daemon=True)
    reader.start()
    bench._check_writable("--json", fifo)
    writer = threading.Thread(target=bench._write_json, args=(fifo, {"rows": 1}), daemon=True)
    writer.start()
    writer.join(10)
    reader.join(10)
    assert not writer.is_alive() and json.loads(got[0]) == {"rows": 1}


def test_the_plot_file_checked_and_named_is_the_one_matplotlib_writes(monkeypatch, tmp_path):
    """A name without an extension gets .png: the check looked at the name as given,
    and the closing message named "out." where the file was out.png."""
    from qdispatch.__main__ import main
    assert [bench.plot_file(p) for p in ("out", "out.", "out.svg", "a.b/out")] == \
        ["out.png", "out.png", "out.svg", "a.b/out.png"]
    (tmp_path / "h.png").mkdir()
    monkeypatch.setattr(bench, "_run_cases", refuse_to_run)
    monkeypatch.setattr(bench, "require_matplotlib", lambda: None)
    with pytest.raises(SystemExit, match=r"^--plot .*h\.png: can't write there \(Is a directory\)"):
        main(["bench", "--shapes", "2x64x64", "--threads", "1", "--plot", str(tmp_path / "h")])


@pytest.mark.skipif(bench.available_memory_bytes() is None, reason="needs /proc/meminfo's MemAvailable")
def test_a_read_buffer_past_the_memory_is_refused_before_anything_runs(monkeypatch):
    """It was allocated after every case had run, and its MemoryError lost their results."""
    from qdispatch.__main__ import main
    monkeypatch.setattr(bench, "_run_cases", refuse_to_run)
    with pytest.raises(SystemExit, match=r"^--bandwidth-mb 100000000: the streaming read's buffer would take more "
                                         r"than the \d+ MiB of memory available"):
        main(["bench", "--shapes", "2x64x64", "--threads", "1", "--bandwidth-mb", "100000000"])


def test_a_plot_format_matplotlib_cant_write_is_refused_before_anything_runs(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    from qdispatch.__main__ import main
    monkeypatch.setattr(bench, "_run_cases", refuse_to_run)
    with pytest.raises(SystemExit, match=r"^--plot .*bench\.foo: matplotlib can't write \.foo files; use one of .*png"):
        main(["bench", "--shapes", "2x64x64", "--threads", "1", "--plot", str(tmp_path / "bench.foo")])


def test_all_contenders_may_come_with_others():
    args = argparse.Namespace(contenders=["all", "fbgemm"], paths=["qq_int8"], backend=["reference"], shapes=[], json=None,
                              plot=None, bandwidth_mb=None)
    assert bench._check_arguments(args) == list(bench.CONTENDERS)


def test_comma_lists_take_spaces_and_name_each_item_once():
    """'cpu, reference' was refused as backend ' reference'; a case named twice ran twice."""
    assert bench.comma_list(str)("cpu, reference,cpu") == ["cpu", "reference"]
    assert bench.comma_list(bench.count)(" 1, 2 ,1") == [1, 2]


def test_an_unknown_contender_beside_all_is_refused():
    args = argparse.Namespace(contenders=["all", "foo"], paths=["qq_int8"], backend=["reference"], shapes=[], json=None,
                              plot=None, bandwidth_mb=None)
    with pytest.raises(SystemExit, match="unknown contender foo"):
        bench._check_arguments(args)


def test_a_case_whose_shape_its_path_cant_run_skips_under_pytest():
    """The pytest benchmarks ran int4 at K = 40 and failed, where the command refuses it."""
    assert "K=40 must be a multiple of 32" in bench.Case(bench.Shape(1, 40, 64), "int4", "cpu", 1).skip_reason()


@pytest.mark.parametrize("option,value,message", [
    ("--bench-threads", "0", "0 is no count"),
    ("--bench-bandwidth-mb", "0", "0 is no count"),
    ("--bench-shapes", "1x2", "shape '1x2' is not MxKxN"),
])
def test_pytest_options_are_checked_as_the_commands_are(tmp_path, option, value, message):
    """--bench-threads 0 ran cases labelled t0; --bench-bandwidth-mb 0 meant the default."""
    pytest.importorskip("pytest_benchmark")
    proc = _run(["-m", "pytest", BENCHMARKS, "--collect-only", "-q", "-p", "no:cacheprovider", option, value],
                cwd=tmp_path)
    assert proc.returncode == 4 and message in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]



def test_a_shape_whose_check_would_not_fit_memory_is_skipped_before_it_starts(monkeypatch, capsys):
    """1x45000x45000 (8 GB of float32 weights) raised no MemoryError on a 24 GB machine:
    its result check's float64 copies grew the process until the OS killed it, with no
    message and no results.  A case now needs its estimate free before it starts."""
    from qdispatch.__main__ import main
    monkeypatch.setattr(bench, "available_memory_bytes", lambda: 1 << 20)  # 1 MiB free
    monkeypatch.setattr(bench, "operands", lambda shape: pytest.fail(f"made the operands of {shape}")
                        if shape == bench.Shape(2, 64, 8192) else bench_operands(shape))
    assert bench.case_memory_bytes(bench.Shape(2, 64, 64)) < 1 << 20 < bench.case_memory_bytes(bench.Shape(2, 64, 8192))
    assert main(["bench", "--shapes", "2x64x64,2x64x8192", "--threads", "1", "--paths", "qq_int8",
                 "--repeat", "1", "--bandwidth-mb", "1", "--rotation-mb", "1"]) == 0
    out = capsys.readouterr().out
    assert ("skipped 2x64x8192-qq_int8-cpu-t1: it needs about 16.0 MiB (its operands and the float64 check of its "
            "result), more than the 1.0 MiB free here") in out
    assert "2x64x64  " in out  # measured


bench_operands = bench.operands


def test_a_shape_too_large_for_memory_is_skipped_with_the_others_run(monkeypatch, capsys):
    """Operands past the free memory ended the whole run in a MemoryError traceback."""
    from qdispatch.__main__ import main
    _operands_past_memory_at_three_rows(monkeypatch)
    assert main(["bench", "--shapes", "2x64x64,3x64x64", "--threads", "1", "--paths", "qq_int8",
                 "--repeat", "1", "--bandwidth-mb", "1", "--rotation-mb", "1"]) == 0
    out = capsys.readouterr().out
    assert "skipped 3x64x64-qq_int8-cpu-t1: its operands need more memory than is free here" in out
    assert "2x64x64" in out
    # every case skipped: the exit status says that nothing was measured (it was 0), and
    # neither the ceilings (a buffer of up to 16x the cache) nor an empty table come first
    monkeypatch.setattr(bench, "ceilings", lambda *args: pytest.fail("measured the ceilings of nothing"))
    assert main(["bench", "--shapes", "3x64x64", "--threads", "1", "--paths", "qq_int8",
                 "--repeat", "1", "--bandwidth-mb", "1", "--rotation-mb", "1"]) == 1
    out, err = capsys.readouterr()
    assert "nothing was measured: every case was skipped" in err and "GOP/s" not in out


def test_a_contender_for_none_of_the_paths_is_refused():
    """`--contenders fbgemm --paths fq_int8` ran no contender and printed "-" for its ratio."""
    args = argparse.Namespace(contenders=["fbgemm"], paths=["fq_int8", "int4"], backend=["reference"], shapes=[],
                              json=None, plot=None, bandwidth_mb=None)
    with pytest.raises(SystemExit, match=r"^contender fbgemm times none of --paths fq_int8,int4: it times w8a8; "
                                         r"add that to --paths$"):
        bench._check_arguments(args)


def test_numpys_row_is_named_by_its_job_in_the_table():
    """The one numpy row of a shape is every path's base, but was named after the first path."""
    rows = [{"shape": "2x64x64", "path": "qq_int8", "impl": impl, "threads": 1, "ms": 0.01, "gops": 1.0,
             "weight_gbs": 1.0, "ratio_numpy_f32": 1.0} for impl in ("numpy_f32", "cpu")]
    numpy_line, cpu_line = bench.format_table(rows).splitlines()[2:]
    assert numpy_line.split()[1:3] == ["matmul", "numpy_f32"] and cpu_line.split()[1:3] == ["qq_int8", "cpu"]
