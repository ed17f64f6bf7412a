"""Embedding: the C example and a Cython extension, built against the installed package.

The shell commands below are the ones the "Embedding from C" section of the
README shows; a test checks that they stay the same there."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import qdispatch as qd
from helpers import built_with_openmp, run_python

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
EXAMPLES = os.path.join(ROOT, "examples", "c")
DOCS = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "embedding.md")]

BUILD_SHARED = ("cc examples/c/quantize_matmul.c $(qdispatch config --cflags --libs) -lm "
                "-o quantize_matmul && ./quantize_matmul")
BUILD_STATIC = ("cc examples/c/quantize_matmul.c $(qdispatch config --cflags --libs --static) "
                "-o quantize_matmul_static && ./quantize_matmul_static")
BUILD_CMAKE = ('cmake -S examples/c -B build/c -Dqdispatch_DIR="$(qdispatch config --cmake)" && '
               'cmake --build build/c && build/c/quantize_matmul')

INSTALLED_COMMAND = os.path.join(os.path.dirname(sys.executable), "qdispatch")  # pip puts it beside python
needs_examples = pytest.mark.skipif(not os.path.isdir(EXAMPLES), reason="examples/c not beside the tests")


@pytest.fixture
def shell_env(tmp_path):
    """An environment where `python` is the interpreter running the tests, and
    `qdispatch` its installed command (or, for a package built in place, which has
    none, that python's `-m qdispatch`)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # Wrappers, not symlinks: a virtual environment's python must run under its own path.
    commands = {"python": f'"{sys.executable}"'}
    if not os.path.isfile(INSTALLED_COMMAND):
        commands["qdispatch"] = f'"{sys.executable}" -m qdispatch'
    for name, run in commands.items():
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {run} "$@"\n')
        (bin_dir / name).chmod(0o755)
    path = os.pathsep.join([str(bin_dir), os.path.dirname(INSTALLED_COMMAND), os.environ.get("PATH", "")])
    return dict(package_env(), PATH=path)


def package_env():
    """The environment with the qdispatch under test importable (installed or built in place)."""
    import qdispatch
    return dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(qdispatch.__file__))))


def run_shell(command, cwd, env):
    proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{command}\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@needs_examples
@pytest.mark.parametrize("command", [BUILD_SHARED, BUILD_STATIC], ids=["shared", "static"])
def test_c_example_builds_and_passes(c_compiler, shell_env, tmp_path, command):
    shutil.copytree(EXAMPLES, tmp_path / "examples" / "c")
    out = run_shell(command, tmp_path, shell_env)
    assert f"qdispatch {qd.__version__} kernels" in out  # the library knows its release
    assert "all checks passed" in out
    assert "the input holds NaN or Inf" in out  # bad input came back as a status


@needs_examples
@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_c_example_makefile(c_compiler, shell_env, tmp_path):
    shutil.copytree(EXAMPLES, tmp_path / "c")
    out = run_shell("make check", tmp_path / "c", shell_env)
    assert out.count("all checks passed") == 2


@needs_examples
@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_c_example_makefile_from_a_folder_with_spaces(c_compiler, shell_env, tmp_path):
    """A package installed under "My Projects" (a virtual environment in a user's
    folder): `config` gave its paths unescaped, and make's compile split them."""
    import qdispatch
    home = tmp_path / "My Projects"
    shutil.copytree(os.path.dirname(os.path.abspath(qdispatch.__file__)), home / "qdispatch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(EXAMPLES, tmp_path / "c")
    out = run_shell("make check", tmp_path / "c", dict(shell_env, PYTHONPATH=str(home)))
    assert out.count("all checks passed") == 2
    assert f"-I{home}/qdispatch/include".replace(" ", "\\ ") in out  # make echoes the escaped flags


@needs_examples
@pytest.mark.skipif(shutil.which("pkg-config") is None, reason="pkg-config is not installed")
def test_the_pkg_config_file_builds_the_example(c_compiler, shell_env, tmp_path):
    """`qdispatch config --pc` for build systems that ask pkg-config (CMake's
    pkg_check_modules, Meson's dependency()): its flags are config's, and build."""
    shutil.copytree(EXAMPLES, tmp_path / "examples" / "c")
    (tmp_path / "pc").mkdir()
    run_shell("qdispatch config --pc > pc/qdispatch.pc", tmp_path, shell_env)
    env = dict(shell_env, PKG_CONFIG_PATH=str(tmp_path / "pc"))
    assert run_shell("pkg-config --modversion qdispatch", tmp_path, env).strip() == qd.__version__
    flags = run_shell("pkg-config --cflags --libs qdispatch", tmp_path, env).split()
    assert flags == run_shell("qdispatch config --cflags --libs", tmp_path, shell_env).split()
    static = run_shell("pkg-config --static --libs qdispatch", tmp_path, env).split()
    assert ("-fopenmp" in static) == built_with_openmp()
    out = run_shell("cc examples/c/quantize_matmul.c $(pkg-config --cflags --libs qdispatch) -lm -o qm && ./qm",
                    tmp_path, env)
    assert "all checks passed" in out


def cmake_build(source, build, package_dir, env, *options):
    """Configures and builds `source` with qdispatch's CMake package from `package_dir`."""
    configure = subprocess.run(["cmake", "-S", str(source), "-B", str(build), f"-Dqdispatch_DIR={package_dir}",
                                *options], env=env, capture_output=True, text=True)
    if configure.returncode == 0:
        run_shell(f'cmake --build "{build}"', build, env)
    return configure


@needs_examples
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_the_cmake_package_builds_the_example(c_compiler, shell_env, tmp_path):
    """find_package(qdispatch) with qdispatch_DIR from `qdispatch config --cmake`:
    the shared and the static target both build the example, and it passes."""
    shutil.copytree(EXAMPLES, tmp_path / "examples" / "c")
    assert "all checks passed" in run_shell(BUILD_CMAKE, tmp_path, shell_env)
    assert "all checks passed" in run_shell("build/c/quantize_matmul_static", tmp_path, shell_env)
    package_dir = run_shell("qdispatch config --cmake", tmp_path, shell_env).strip()
    cache = (tmp_path / "build" / "c" / "CMakeCache.txt").read_text().splitlines()
    assert [line.split("=", 1)[1] for line in cache if line.startswith("qdispatch_DIR:")] == [package_dir]


@needs_examples
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_the_cmake_package_of_a_moved_install_finds_its_own_files(c_compiler, shell_env, tmp_path):
    """The package's paths come from its own folder: a copy under "My Projects" (a
    copied virtual environment) builds against the copy's libraries."""
    import qdispatch
    home = tmp_path / "My Projects"
    shutil.copytree(os.path.dirname(os.path.abspath(qdispatch.__file__)), home / "qdispatch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(EXAMPLES, tmp_path / "c")
    package_dir = home / "qdispatch" / "lib" / "cmake" / "qdispatch"
    configure = cmake_build(tmp_path / "c", tmp_path / "build", package_dir, shell_env)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    out = run_shell("ldd ./quantize_matmul || true", tmp_path / "build", shell_env)
    assert f"{home}/qdispatch/lib/libqdispatch.so" in out
    assert "all checks passed" in run_shell("./quantize_matmul", tmp_path / "build", shell_env)


@needs_examples
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_a_program_linked_by_the_cmake_package_runs_once_installed(c_compiler, shell_env, tmp_path):
    """`cmake --install` drops CMake's build rpath: the shared target's own rpath is what
    lets the installed program find libqdispatch.so (as `config --libs` gives one)."""
    shutil.copytree(EXAMPLES, tmp_path / "c")
    lists = tmp_path / "c" / "CMakeLists.txt"
    lists.write_text(lists.read_text() + "\ninstall(TARGETS quantize_matmul DESTINATION bin)\n")
    configure = cmake_build(tmp_path / "c", tmp_path / "build", qd.get_cmake_dir(), shell_env,
                            f"-DCMAKE_INSTALL_PREFIX={tmp_path / 'installed'}")
    assert configure.returncode == 0, configure.stdout + configure.stderr
    run_shell(f'cmake --install "{tmp_path / "build"}"', tmp_path, shell_env)
    env = {key: value for key, value in shell_env.items() if key != "LD_LIBRARY_PATH"}
    assert "all checks passed" in run_shell("installed/bin/quantize_matmul", tmp_path, env)


@needs_examples
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_the_cmake_package_refuses_another_release_and_a_broken_install(c_compiler, shell_env, tmp_path):
    import qdispatch
    shutil.copytree(EXAMPLES, tmp_path / "c")
    lists = tmp_path / "c" / "CMakeLists.txt"
    text = lists.read_text()
    this_release = ".".join(qd.__version__.split(".")[:2])  # 0.1 of 0.1.x
    lists.write_text(text.replace("find_package(qdispatch CONFIG", f"find_package(qdispatch {this_release} CONFIG"))
    met = cmake_build(tmp_path / "c", tmp_path / "b0", qd.get_cmake_dir(), shell_env)
    assert met.returncode == 0, met.stdout + met.stderr
    lists.write_text(text.replace("find_package(qdispatch CONFIG", "find_package(qdispatch 9.0 CONFIG"))
    refused = cmake_build(tmp_path / "c", tmp_path / "b1", qd.get_cmake_dir(), shell_env)
    assert refused.returncode != 0
    assert f"version: {qd.__version__}" in " ".join(refused.stderr.split())  # CMake names the version it found
    copy = tmp_path / "copy"
    shutil.copytree(os.path.dirname(os.path.abspath(qdispatch.__file__)), copy / "qdispatch",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "qdispatch" / "lib" / "libqdispatch.a").unlink()
    shutil.copytree(EXAMPLES, tmp_path / "c2")
    broken = cmake_build(tmp_path / "c2", tmp_path / "b2", copy / "qdispatch" / "lib" / "cmake" / "qdispatch",
                         shell_env)
    assert broken.returncode != 0
    assert "libqdispatch.a is missing: reinstall qdispatch" in " ".join(broken.stderr.split())  # CMake wraps lines


def test_config_points_at_the_installed_files():
    assert os.path.isfile(os.path.join(qd.get_include(), "qdispatch.h"))
    for name in ("libqdispatch.so", "libqdispatch.a"):
        assert os.path.isfile(os.path.join(qd.get_library_dir(), name))


def test_static_libs_name_openmp_exactly_when_the_library_uses_it():
    with open(os.path.join(qd.get_library_dir(), "libqdispatch.a"), "rb") as f:
        uses_openmp = b"omp_get_num_procs" in f.read()
    static = run_python("-m", "qdispatch", "config", "--libs", "--static")
    assert static.returncode == 0, static.stderr
    assert ("-fopenmp" in static.stdout.split()) == uses_openmp == built_with_openmp()


def header_functions():
    """The names of the functions qdispatch.h declares (static inline ones aside)."""
    import re
    with open(os.path.join(qd.get_include(), "qdispatch.h")) as f:
        text = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
    inline = set(re.findall(r"static inline[^(]*?\b(qd_\w+)\(", text))
    return sorted(set(re.findall(r"\b(qd_\w+)\(", text)) - inline)


@pytest.mark.parametrize("link", ["--libs", "--libs --static"], ids=["shared", "static"])
def test_every_declared_function_links(c_compiler, shell_env, tmp_path, link):
    """Each function of the header is in both libraries (the CUDA ones as stubs that
    report QD_ERR_CUDA_UNAVAILABLE), so no embedder meets an undefined symbol."""
    names = header_functions()
    assert "qd_abi_version" in names and "qd_cuda_fq_untile_weights" in names
    refs = ",\n    ".join(f"(fn){n}" for n in names)
    (tmp_path / "all.c").write_text(
        "#include <qdispatch.h>\ntypedef void (*fn)(void);\n"
        f"static fn functions[] = {{\n    {refs}\n}};\n"
        "int main(void) { return functions[0] == 0 || qd_abi_version() != QD_ABI_VERSION; }\n")
    run_shell(f"{c_compiler} all.c $(qdispatch config --cflags {link}) -lm -o all && ./all",
              tmp_path, shell_env)


@pytest.mark.parametrize("std", ["-std=c99", "-std=gnu99"])
def test_the_header_compiles_cleanly_under_strict_warnings(c_compiler, shell_env, tmp_path, std):
    """Python's own CFLAGS may hold -Werror=declaration-after-statement, which a
    Cython extension that includes the header inherits: its inline size helpers
    declared a variable after a statement."""
    (tmp_path / "strict.c").write_text("#include <qdispatch.h>\nint main(void) { return qd_abi_version() < 0; }\n")
    run_shell(f"{c_compiler} {std} -pedantic -Wall -Wextra -Wdeclaration-after-statement -Wshadow -Werror "
              f"-fsyntax-only $(qdispatch config --cflags) strict.c", tmp_path, shell_env)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="dlopen's libdl and ELF's nodelete")
def test_the_shared_library_survives_dlclose_after_threaded_calls(c_compiler, shell_env, tmp_path):
    """A host that loads the library as a plugin and unloads it: dlclose took the
    OpenMP runtime with it while its idle worker threads still ran (a crash)."""
    library = os.path.join(qd.get_library_dir(), "libqdispatch.so")
    (tmp_path / "plugin.c").write_text(textwrap.dedent(f"""\
        #include <dlfcn.h>
        #include <stdint.h>
        #include <stdio.h>
        #include <unistd.h>
        typedef int (*matmul_fn)(const int8_t *, int64_t, int64_t, const int8_t *, int64_t, int32_t *);
        static int8_t a[256 * 256], b[256 * 256];
        static int32_t c[256 * 256];
        int main(void) {{
            for (int round = 0; round < 3; round++) {{
                void *lib = dlopen("{library}", RTLD_NOW | RTLD_LOCAL);
                if (!lib) {{ printf("%s\\n", dlerror()); return 1; }}
                ((void (*)(int))dlsym(lib, "qd_set_num_threads"))(2);
                a[round] = 1; b[round * 256] = 3;
                const int status = ((matmul_fn)dlsym(lib, "qd_int_matmul_s8"))(a, 256, 256, b, 256, c);
                printf("%d %d ", status, c[0]);
                dlclose(lib);
                usleep(50000);  /* the worker threads wake up meanwhile */
            }}
            return 0;
        }}
        """))
    out = run_shell(f"{c_compiler} plugin.c -o plugin -ldl && ./plugin", tmp_path, shell_env).split()
    assert out == ["0", "3", "0", "6", "0", "9"]


def test_the_cython_declarations_cover_the_header():
    """`cimport qdispatch` declared only the CPU functions: the CUDA half of the header,
    which a library built without CUDA holds as stubs, was missing."""
    import re
    with open(os.path.join(os.path.dirname(qd.__file__), "qdispatch_c.pxd")) as f:
        pxd = f.read()
    missing = [name for name in header_functions() if not re.search(rf"\b{name}\(", pxd)]
    assert not missing


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) is not installed")
def test_the_shared_library_exports_the_headers_functions_and_no_other_of_ours():
    """Internal functions (qd_aligned_alloc, qd_kernels_avx2, ...) were exported too,
    where an embedder's function of the same name would meet them."""
    nm = subprocess.run(["nm", "-D", "--defined-only", os.path.join(qd.get_library_dir(), "libqdispatch.so")],
                        capture_output=True, text=True)
    assert nm.returncode == 0, nm.stderr
    exported = {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
    declared = set(header_functions())
    assert declared <= exported, sorted(declared - exported)
    # the CUDA runtime linked in keeps its own names; any of ours (C names, or C++ ones in namespace qd) is leaked
    leaked = {name for name in exported - declared if "qd" in name}
    assert not leaked, sorted(leaked)


def test_cuda_tile_sizes_are_zero_for_what_the_tiling_refuses(c_compiler, shell_env, tmp_path):
    """The tile size helpers are inline in the header: a bit width, block_k or size
    that the tiling calls refuse gives 0, not a division by zero or an overflow in the
    program."""
    (tmp_path / "sizes.c").write_text(textwrap.dedent("""\
        #include <stdio.h>
        #include <qdispatch.h>
        int main(void) {
            volatile int bits[] = {0, 3, 32, 4};
            volatile long long block_k[] = {0, -32, 5, 32};
            for (int i = 0; i < 4; i++)
                printf("%lld ", (long long)qd_cuda_fq_tiles_bytes(17, 100, bits[i]));
            for (int i = 0; i < 4; i++)
                printf("%lld ", (long long)qd_cuda_fq_scale_tiles_bytes(17, 96, block_k[i]));
            volatile long long tile_bytes[] = {0, -64};  /* the shared helper divided by it */
            for (int i = 0; i < 2; i++)
                printf("%lld ", (long long)qd_cuda_tiles_size(1, 1, tile_bytes[i]));
            /* sizes of no weight, and sizes past INT64_MAX: 0, not a negative or wrapped size */
            volatile long long dims[][2] = {{-100, 64}, {64, 0}, {INT64_MAX, 16}, {1ll << 40, 1ll << 40}};
            for (int i = 0; i < 4; i++)
                printf("%lld %lld ", (long long)qd_cuda_fq_tiles_bytes(dims[i][0], dims[i][1], 8),
                       (long long)qd_cuda_fq_scale_tiles_bytes(dims[i][0], dims[i][1], 16));
            return 0;
        }
        """))
    out = run_shell(f"{c_compiler} sizes.c $(qdispatch config --cflags) -o sizes && ./sizes",
                    tmp_path, shell_env)
    assert out.split() == ["0", "0", "0", "2048", "0", "0", "0", "384", "0", "0"] + ["0"] * 8


# ---- bad input to the C entry points comes back as a status ----

def c_program_output(c_compiler, shell_env, tmp_path, body):
    """Builds a C program whose main() is `body` against the installed library, runs
    it and returns what it printed, split into words."""
    (tmp_path / "prog.c").write_text(
        "#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n#include <qdispatch.h>\n"
        "int main(void) {\n" + textwrap.dedent(body) + "\n    return 0;\n}\n")
    return run_shell(f"{c_compiler} prog.c $(qdispatch config --cflags --libs) -lm -o prog && ./prog",
                     tmp_path, shell_env).split()


def test_float16_conversion_rounds_to_nearest_even_in_any_rounding_mode(c_compiler, shell_env, tmp_path):
    """Results in float16's subnormal range were rounded by a float add, so by the
    caller's rounding mode: the header promises nearest even, as numpy gives, on every
    ISA (F16C converts 8 values at a time) and, on x86, with flush-to-zero and
    denormals-are-zero set too.  Both ways, float16 subnormals and signalling NaNs
    included."""
    values = np.array([1e-8, 3e-8, -1e-7, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -26, 6.1e-5, -5.9e-8,
                       1e-40, -1e-40, 65519.99, 65520, 2049, 2051, -np.inf, 0.1], np.float32)
    signalling = np.array([0x7F800001, 0xFF800400, 0x7FC00000], np.uint32).view(np.float32)
    values = np.concatenate([values, signalling, values[:5]])  # 24: a group of 8 with NaNs
    with np.errstate(over="ignore"):  # 65520 rounds to inf, as it should
        halves = values.astype(np.float16)
    want_narrow = " ".join(f"{b:04x}" for b in halves.view(np.uint16))
    want_wide = " ".join(f"{b:08x}" for b in halves.astype(np.float32).view(np.uint32))
    float_bits = ", ".join(f"0x{b:08x}u" for b in values.view(np.uint32))
    half_bits = ", ".join(f"0x{b:04x}u" for b in halves.view(np.uint16))
    (tmp_path / "modes.c").write_text(textwrap.dedent(f"""\
        #include <fenv.h>
        #include <stdio.h>
        #include <string.h>
        #include <qdispatch.h>
        #if defined(__x86_64__) || defined(__i386__)
        #include <xmmintrin.h>
        #define FLUSH_MODES 2  /* then FTZ and DAZ set */
        #else
        #define FLUSH_MODES 1
        #endif
        enum {{ N = {len(values)} }};
        int main(void) {{
            const uint32_t float_bits[N] = {{{float_bits}}};
            const uint16_t half_bits[N] = {{{half_bits}}};
            float values[N], wide[N];
            uint16_t narrow[N];
            memcpy(values, float_bits, sizeof values);
            const int modes[] = {{FE_UPWARD, FE_DOWNWARD, FE_TOWARDZERO, FE_TONEAREST}};
            for (int isa = 0; isa < QD_ISA_COUNT; isa++) {{
                if (qd_isa_set((qd_isa)isa) != QD_OK) continue;  /* not built, or not this CPU's */
                for (int flush = 0; flush < FLUSH_MODES; flush++)
                    for (int m = 0; m < 4; m++) {{
                        fesetround(modes[m]);
        #if defined(__x86_64__) || defined(__i386__)
                        if (flush) _mm_setcsr(_mm_getcsr() | 0x8040u);
        #endif
                        const qd_status narrowed = qd_convert_f32_to_f16(values, N, narrow);
                        const qd_status widened = qd_convert_f16_to_f32(half_bits, N, wide);
        #if defined(__x86_64__) || defined(__i386__)
                        _mm_setcsr(_mm_getcsr() & ~0x8040u);
        #endif
                        fesetround(FE_TONEAREST);
                        if (narrowed != QD_OK || widened != QD_OK) return 1;
                        printf("isa%d", isa);
                        for (int i = 0; i < N; i++) printf(" %04x", narrow[i]);
                        printf("\\n");
                        for (int i = 0; i < N; i++) {{
                            uint32_t b;
                            memcpy(&b, wide + i, 4);
                            printf("%08x%s", b, i + 1 < N ? " " : "\\n");
                        }}
                    }}
            }}
            return 0;
        }}
        """))
    out = run_shell(f"{c_compiler} modes.c $(qdispatch config --cflags --libs) -lm -o modes && ./modes",
                    tmp_path, shell_env).splitlines()
    ran = sorted({line.split()[0] for line in out[::2]})
    assert "isa0" in ran and len(out) >= 8, out  # the scalar kernels at least, in 4 modes
    assert out[0::2] == [f"{line.split()[0]} {want_narrow}" for line in out[0::2]]
    assert out[1::2] == [want_wide] * (len(out) // 2)


def test_packed_weights_not_made_by_pack_are_refused(c_compiler, shell_env, tmp_path):
    """Zeroed memory passed as packed weights is refused, not read as sizes (nbytes and
    unpack divided by its zero block) nor freed; pack leaves *out NULL on every error."""
    out = c_program_output(c_compiler, shell_env, tmp_path, """\
        void *zeroed = calloc(1, 4096);
        qd_packed_weights *pw = zeroed;
        int8_t a[4] = {0}, w[4];
        int32_t c[4];
        float s[4] = {1, 1, 1, 1}, x[4] = {0}, out[4];
        printf("%d %d %d %d %d %d %d %d ", qd_packed_weights_info(pw, NULL, NULL, NULL, NULL, NULL),
               qd_unpack_weights(pw, w, s), qd_int_matmul_packed(a, 1, 4, pw, c),
               qd_qq_matmul(a, 1, 4, s, 1, 4, pw, out), qd_fq_matmul_f32(x, 1, 4, pw, out),
               qd_w8a8_matmul_f32(x, 1, 4, QD_Q8S, 4, pw, out), qd_dequantize_packed(pw, out, QD_FLOAT32),
               (int)qd_packed_weights_nbytes(pw));
        qd_packed_weights_free(pw);  /* not the library's to free */
        free(zeroed);
        qd_packed_weights *made = pw;
        const qd_status st = qd_pack_weights(NULL, 1, 4, 8, NULL, 1, 4, &made);
        printf("%d %d", st, made == NULL);
    """)
    assert out == ["3"] * 7 + ["0", "1", "1"]


def test_dequantize_packed_refuses_what_it_cannot_write(c_compiler, shell_env, tmp_path):
    """No weights or no output: QD_ERR_NULL; a dtype that is no float, or an output
    not aligned to its dtype: QD_ERR_ARGUMENT; nothing written then.  A good call gives
    each value times its block's scale."""
    out = c_program_output(c_compiler, shell_env, tmp_path, """\
        const int8_t w[8] = {1, -2, 3, -4, 5, -6, 7, -8};
        const float s[4] = {0.5f, 2, 4, 8};  /* blocks (1, 2) of [2, 4] */
        _Alignas(4) unsigned char buf[40];
        memset(buf, 0x55, sizeof buf);
        qd_packed_weights *pw = NULL;
        if (qd_pack_weights(w, 2, 4, 8, s, 1, 2, &pw) != QD_OK) return 1;
        printf("%d %d %d %d ", qd_dequantize_packed(NULL, buf, QD_FLOAT32), qd_dequantize_packed(pw, NULL, QD_FLOAT32),
               qd_dequantize_packed(pw, buf, 7), qd_dequantize_packed(pw, buf + 1, QD_FLOAT16));
        int untouched = 1;
        for (size_t i = 0; i < sizeof buf; i++) untouched &= buf[i] == 0x55;
        float got[8];
        printf("%d %d", untouched, qd_dequantize_packed(pw, got, QD_FLOAT32));
        for (int i = 0; i < 8; i++) printf(" %g", got[i]);
        qd_packed_weights_free(pw);
    """)
    assert out == ["1", "1", "3", "3", "1", "0"] + ["0.5", "-1", "6", "-8", "20", "-24", "56", "-64"]


def test_quantize_reads_16bit_data_as_its_float32_values(c_compiler, shell_env, tmp_path):
    """qd_quantize of float16 and bfloat16 bits gives qd_quantize_f32's results on their
    float32 values; x's bytes are its dtype's (q right after them is no overlap); a
    dtype that is no float is refused."""
    out = c_program_output(c_compiler, shell_env, tmp_path, """\
        const float x[8] = {1, -2, 3, 0.5f, 0, 0, 0.25f, -0.75f};
        _Alignas(8) uint16_t buf[16];  /* 16-bit x [2, 4], then room for q */
        float s32[2], s[2];
        int8_t q32[8], q[8];
        int64_t bad = -1;
        if (qd_quantize_f32(x, 2, 4, QD_Q8S, 1, 4, QD_SCALE_F32, s32, q32, NULL) != QD_OK)
            return 1;
        for (int dtype = QD_FLOAT16; dtype <= QD_BFLOAT16; dtype++) {
            (dtype == QD_FLOAT16 ? qd_convert_f32_to_f16 : qd_convert_f32_to_bf16)(x, 8, buf);
            const qd_status st = qd_quantize(buf, dtype, 2, 4, QD_Q8S, 1, 4, QD_SCALE_F32, s, q, NULL);
            printf("%d %d ", st, !memcmp(q, q32, sizeof q) && !memcmp(s, s32, sizeof s));
        }
        printf("%d ", qd_quantize(buf, QD_FLOAT16, 2, 4, QD_Q8S, 1, 4, QD_SCALE_F32, s, (int8_t *)(buf + 8), NULL));
        printf("%d ", qd_quantize(buf, QD_FLOAT16, 2, 4, QD_Q8S, 1, 4, QD_SCALE_F32, s, (int8_t *)(buf + 4), NULL));
        printf("%d %d ", qd_quantize(x, 3, 2, 4, QD_Q8S, 1, 4, QD_SCALE_F32, s, q, NULL),
               qd_quantize(x, -1, 2, 4, QD_Q8S, 1, 4, QD_SCALE_F32, s, q, NULL));
        qd_convert_f32_to_f16(x, 8, buf);
        buf[5] = 0x7C00;  /* float16 inf */
        printf("%d ", qd_quantize(buf, QD_FLOAT16, 2, 4, QD_Q8S, 1, 4, QD_SCALE_F32, s, q, &bad));
        printf("%d", (int)bad);
    """)
    assert out == ["0", "1", "0", "1", "0", "3", "3", "3", "9", "5"]


def test_sizes_no_array_could_have_are_refused(c_compiler, shell_env, tmp_path):
    """Dimensions whose byte counts overflow come back as QD_ERR_ARGUMENT; the kernels
    computed their buffer sizes with them, wrapped, and wrote past what they allocated."""
    out = c_program_output(c_compiler, shell_env, tmp_path, """\
        const int64_t huge = (int64_t)1 << 62;
        int8_t a[16] = {0}, q[16];
        int32_t c[16];
        float x[16] = {0}, s[16], out[16];
        uint16_t h[16] = {0};
        qd_packed_weights *pw;
        printf("%d ", qd_int_matmul_s8(a, huge, 1, a, 4, c));
        printf("%d ", qd_quantize_f32(x, huge, 4, QD_Q8S, huge, 4, QD_SCALE_F32, s, q, NULL));
        printf("%d ", qd_pack_weights(a, huge, 4, 8, NULL, huge, 4, &pw));
        printf("%d ", qd_convert_f16_to_f32(h, INT64_MAX, x));
        if (qd_pack_weights(a, 4, 4, 8, NULL, 1, 4, &pw) != QD_OK)
            return 1;
        printf("%d ", qd_int_matmul_packed(a, huge, 4, pw, c));
        printf("%d ", qd_qq_matmul(a, huge, 4, s, huge, 4, pw, out));
        printf("%d ", qd_fq_matmul_f32(x, huge, 4, pw, out));
        printf("%d", qd_w8a8_matmul_f32(x, huge, 4, QD_Q8S, 4, pw, out));
        qd_packed_weights_free(pw);
    """)
    assert out == ["3"] * 8


def test_outputs_that_overlap_inputs_are_refused(c_compiler, shell_env, tmp_path):
    """An output over an input is QD_ERR_ARGUMENT: int_matmul's c written over b while b
    was still being read gave wrong sums with QD_OK, and so did scales written over x
    and in-place widening conversions.  Arrays side by side in one buffer are fine."""
    out = c_program_output(c_compiler, shell_env, tmp_path, """\
        int32_t cb[8];                 /* b [8, 4] int8, with c [2, 4] int32 over it */
        int8_t a[16], q[8];
        memset(a, 1, sizeof a);
        memset(cb, 1, sizeof cb);
        float x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, ws[4];
        qd_packed_weights *pw;
        if (qd_pack_weights(a, 2, 8, 8, NULL, 1, 8, &pw) != QD_OK)
            return 1;
        printf("%d ", qd_int_matmul_s8(a, 2, 8, (int8_t *)cb, 4, cb));
        printf("%d ", qd_quantize_f32(x, 2, 4, QD_Q8S, 1, 4, QD_SCALE_F32, x, q, NULL));
        printf("%d ", qd_fq_matmul_f32(x, 1, 8, pw, x));
        printf("%d ", qd_unpack_weights(pw, (int8_t *)ws, ws + 2));  /* values [2, 8], then scales */
        printf("%d ", qd_convert_f16_to_f32((uint16_t *)x, 4, x));
        printf("%d ", qd_convert_f32_to_bf16(x, 4, (uint16_t *)(x + 4)));  /* side by side */
        x[5] = strtof("nan", NULL);  /* the first NaN's index would have been written over x */
        printf("%d ", qd_quantize_f32(x, 2, 4, QD_Q8S, 1, 4, QD_SCALE_F32, ws, q, (int64_t *)x));
        printf("%d", x[0] == 1 && x[1] == 2);
        qd_packed_weights_free(pw);
    """)
    assert out == ["3"] * 5 + ["0", "3", "1"]


def test_pack_weights_into_its_own_inputs_changes_nothing(c_compiler, shell_env, tmp_path):
    """*out in w (or in the scales) was set to NULL before any check: the weights (or
    scales) were zeroed there, and packing went on, QD_OK, from the changed values."""
    out = c_program_output(c_compiler, shell_env, tmp_path, """\
        _Alignas(8) int8_t w[64];
        _Alignas(8) float s[8] = {1, 2, 3, 4, 5, 6, 7, 8};
        for (int i = 0; i < 64; i++) w[i] = (int8_t)(i + 1);
        printf("%d ", qd_pack_weights(w, 4, 16, 8, NULL, 1, 16, (qd_packed_weights **)w));
        printf("%d ", qd_pack_weights(w, 4, 16, 8, s, 1, 8, (qd_packed_weights **)(s + 2)));
        int same = 1;
        for (int i = 0; i < 64; i++) same &= w[i] == i + 1;
        for (int i = 0; i < 8; i++) same &= s[i] == i + 1;
        printf("%d", same);
    """)
    assert out == ["3", "3", "1"]


def test_dequantize_rows_refuses_misaligned_arrays(c_compiler, shell_env, tmp_path):
    """An out (or packed values) off its dtype's alignment was written (read) through a
    typed pointer: undefined behaviour, which UBSan reports."""
    out = c_program_output(c_compiler, shell_env, tmp_path, """\
        _Alignas(16) int8_t v[16] = {1, 2, 3, 4, 5, 6, 7, 8};
        _Alignas(16) char buf[64];
        float s[2] = {1, 1};
        for (int dtype = QD_FLOAT32; dtype <= QD_BFLOAT16; dtype++)
            printf("%d %d ", qd_dequantize_rows(v, 0, 2, 4, s, 1, 4, NULL, 2, buf + 1, dtype),
                   qd_dequantize_rows(v, 0, 2, 4, s, 1, 4, NULL, 2, buf + (dtype == QD_FLOAT32 ? 4 : 2), dtype));
        printf("%d %d", qd_dequantize_rows(v + 1, 4, 2, 8, s, 1, 8, NULL, 2, buf, QD_FLOAT32),
               qd_dequantize_rows(v + 4, 4, 2, 8, s, 1, 8, NULL, 2, buf, QD_FLOAT32));
    """)
    assert out == ["3", "0"] * 3 + ["3", "0"]


def built_with_cuda():
    from qdispatch._build_config import BUILD_CONFIG
    return BUILD_CONFIG["cuda"] is not None


@pytest.mark.skipif(not built_with_cuda(), reason="the library was built without CUDA kernels")
def test_cuda_entry_points_refuse_overflowing_sizes_and_overlaps(c_compiler, shell_env, tmp_path):
    """The CUDA entry points take the CPU ones' rules: sizes whose byte counts overflow
    and outputs over inputs are QD_ERR_ARGUMENT, found before any CUDA call (the
    pointers here are never dereferenced).  Before, the sizes wrapped in the grid
    arithmetic and the kernels wrote where they pleased, which kills the CUDA context
    for good.  A lookup without ids (the whole table) whose count is not the rows' is
    QD_ERR_SHAPE.  Without a GPU, arrays side by side pass the checks and reach the
    launch, which reports QD_ERR_CUDA_UNAVAILABLE (in place add_bias among them, the
    one overlap the header allows)."""
    out = c_program_output(c_compiler, shell_env, tmp_path, """\
        char *const d = (char *)(uintptr_t)0x7f0000000000;  /* device addresses, never read */
        char *const e = d + (1 << 20), *const f = d + (2 << 20), *const g = d + (3 << 20);
        const int64_t huge = (int64_t)1 << 62;
        const int bf = QD_CUDA_BF16, f32 = QD_CUDA_F32;
        qd_status bad[] = {
            qd_cuda_cast(d, f32, e, QD_CUDA_F16, huge, NULL),
            qd_cuda_cast(d, QD_CUDA_F16, d + 16, f32, 64, NULL),
            qd_cuda_split_bf16((float *)d, huge, 4, 4, e, 8, NULL),
            qd_cuda_split_bf16((float *)d, 2, 4, 4, d + 16, 8, NULL),
            qd_cuda_sum3_f32((float *)d, huge, e, f32, NULL),
            qd_cuda_sum3_f32((float *)d, 16, d + 64, f32, NULL),
            qd_cuda_scale_columns(d, bf, huge, 4, 4, (float *)e, (float *)f, 4, NULL),
            qd_cuda_scale_columns(d, f32, 2, 8, 8, (float *)e, (float *)(d + 16), 8, NULL),
            qd_cuda_scale_columns(d, f32, 2, 8, 8, (float *)e, (float *)(e + 16), 8, NULL),
            qd_cuda_scale_columns(d, QD_CUDA_S8, 2, 8, 8, (float *)e, (float *)f, 8, NULL),
            qd_cuda_add_bias_f32((float *)d, huge, 4, (float *)e, (float *)f, NULL),
            qd_cuda_add_bias_f32((float *)d, 2, 8, (float *)e, (float *)(d + 16), NULL),
            qd_cuda_add_bias_f32((float *)d, 2, 8, (float *)e, (float *)e, NULL),
            qd_cuda_transpose(d, 1, huge, 4, 4, e, NULL),
            qd_cuda_transpose(d, 2, 4, 4, 4, d + 64, NULL),
            qd_cuda_pad_s8((int8_t *)d, huge, 4, (int8_t *)e, 16, NULL),
            qd_cuda_pad_s8((int8_t *)d, 4, 4, (int8_t *)(d + 8), 16, NULL),
            qd_cuda_pack_u32((int8_t *)d, huge, 8, 4, (uint32_t *)e, NULL),
            qd_cuda_pack_u32((int8_t *)d, 4, 8, 4, (uint32_t *)(d + 8), NULL),
            qd_cuda_unpack_u32((uint32_t *)d, huge, 8, 4, (int8_t *)e, NULL),
            qd_cuda_unpack_u32((uint32_t *)d, 4, 8, 4, (int8_t *)(d + 4), NULL),
            qd_cuda_quantize_f32((float *)d, huge, 4, QD_Q8S, huge, 4, QD_SCALE_F32, (float *)e,
                                 (int8_t *)f, g, NULL, NULL),
            qd_cuda_quantize_f32((float *)d, 2, 4, QD_Q8S, 1, 4, QD_SCALE_F32, (float *)(d + 4),
                                 (int8_t *)f, g, NULL, NULL),
            qd_cuda_quantize_f32((float *)d, 2, 4, QD_Q8S, 1, 4, QD_SCALE_F32, (float *)e,
                                 (int8_t *)f, f, NULL, NULL),
            qd_cuda_dequantize(d, 0, huge, 4, (float *)e, huge, 4, (float *)f, NULL),
            qd_cuda_dequantize(d, 4, 4, 8, (float *)e, 1, 8, (float *)(e + 8), NULL),
            qd_cuda_dequantize_rows(d, 0, huge, 4, (float *)e, 1, 4, (int64_t *)g, 2, f, f32, NULL),
            qd_cuda_dequantize_rows(d, 0, 4, 4, (float *)e, 1, 4, (int64_t *)g, huge, f, bf, NULL),
            qd_cuda_dequantize_rows(d, 0, 4, 4, (float *)e, 1, 4, (int64_t *)g, 2, g + 4, f32, NULL),
            qd_cuda_dequantize_rows(d, 0, 4, 4, (float *)e, 1, 4, (int64_t *)g, 2, f, QD_CUDA_S8, NULL),
            qd_cuda_int_matmul_s8((int8_t *)d, (int8_t *)e, 4, 4, 16, (int64_t)1 << 60, (int32_t *)f, NULL),
            qd_cuda_int_matmul_s8((int8_t *)d, (int8_t *)e, 2, 4, 16, 16, (int32_t *)(e + 16), NULL),
            qd_cuda_qq_matmul((int8_t *)d, (int8_t *)e, 2, 4, 16, 16, (float *)g, 1, 16, (float *)f, 1, 16,
                              g + 4, f32, NULL),
            qd_cuda_fq_tile_weights((int8_t *)d, huge, 64, 64, 4, e, NULL),
            qd_cuda_fq_tile_weights((int8_t *)d, 16, 64, 64, 8, d + 512, NULL),
            qd_cuda_fq_untile_weights(d, 16, 64, 4, (int8_t *)(d + 256), 64, NULL),
            qd_cuda_fq_dequantize_rows(d, 4, huge, 64, (float *)e, 1, 64, (int64_t *)g, 2, f, f32, NULL),
            qd_cuda_fq_dequantize_rows(d, 4, 16, 64, (float *)e, 1, 64, (int64_t *)g, 2, d + 256, f32, NULL),
            qd_cuda_fq_tile_scales((float *)d, huge, 64, 1, 64, e, NULL),
            qd_cuda_fq_tile_scales((float *)d, 16, 64, 1, 64, d + 32, NULL),
            qd_cuda_fq_expand_weights(d, huge, 64, 4, bf, e, 64, NULL),
            qd_cuda_fq_expand_weights(d, 16, 64, 4, bf, d + 16, 64, NULL),
            qd_cuda_fq_matmul(d, bf, huge, 64, e, f, 4, 16, 64, 64, g, bf, NULL),
            qd_cuda_fq_matmul(d, bf, 2, 64, e, f, 4, 16, 64, 64, d + 128, bf, NULL),
            qd_cuda_fq_matmul(d, bf, 2, 64, e, f, 4, 16, 64, 64, f + 32, bf, NULL),
            qd_cuda_fq_gemm(d, e, bf, 4, 16, 64, (int64_t)1 << 60, (float *)f, 1, 64, g, f32, NULL),
            qd_cuda_fq_gemm(d, e, bf, 2, 16, 64, 64, (float *)f, 1, 64, e + 256, f32, NULL),
            qd_cuda_fq_values(d, bf, huge, 64, (int8_t *)e, 16, 64, 64, (float *)f, 1, 1, g, f32, NULL),
            qd_cuda_fq_values(d, bf, 2, 64, (int8_t *)e, 16, 64, 64, (float *)f, 1, 1, e + 512, f32, NULL),
            /* no ids: every row, so n must be the rows' count (QD_ERR_SHAPE) */
            qd_cuda_dequantize_rows(d, 0, 4, 4, (float *)e, 1, 4, NULL, 3, f, bf, NULL),
            qd_cuda_fq_dequantize_rows(d, 4, 16, 64, (float *)e, 1, 64, NULL, 15, f, f32, NULL),
        };
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
            printf("%d ", bad[i]);
        printf("| ");
        if (qd_cuda_available())
            return 0;
        qd_status side_by_side[] = {
            qd_cuda_cast(d, QD_CUDA_F16, d + 128, f32, 64, NULL),
            qd_cuda_add_bias_f32((float *)d, 2, 8, (float *)e, (float *)d, NULL),
            qd_cuda_transpose(d, 2, 4, 4, 4, d + 128, NULL),
            qd_cuda_dequantize_rows(d, 0, 4, 4, (float *)e, 1, 4, (int64_t *)g, 2, g + 16, bf, NULL),
            qd_cuda_fq_dequantize_rows(d, 4, 16, 64, (float *)e, 1, 64, (int64_t *)g, 2, d + 512, bf, NULL),
            qd_cuda_int_matmul_s8((int8_t *)d, (int8_t *)(d + 32), 2, 4, 16, 16, (int32_t *)(d + 96), NULL),
            qd_cuda_fq_matmul(d, bf, 2, 64, e, f, 4, 16, 64, 64, d + 256, bf, NULL),
            qd_cuda_fq_values(d, bf, 2, 64, (int8_t *)e, 16, 64, 64, (float *)f, 1, 1, d + 256, bf, NULL),
            qd_cuda_scale_columns(d, bf, 2, 8, 8, (float *)e, (float *)(d + 32), 8, NULL),
        };
        for (size_t i = 0; i < sizeof side_by_side / sizeof side_by_side[0]; i++)
            printf("%d ", side_by_side[i]);
    """)
    assert out[:out.index("|")] == ["3"] * 49 + ["2"] * 2
    assert out[out.index("|") + 1:] in ([], ["11"] * 9)


@pytest.mark.skipif(not built_with_cuda(), reason="the library was built without CUDA kernels")
def test_cuda_entry_points_give_the_headers_status_for_each_fault(c_compiler, shell_env, tmp_path):
    """Faults of one kind get one status on every CUDA entry point, as on the CPU:
    sizes no array could have QD_ERR_ARGUMENT (an int64 past the kernels' int limits
    was QD_ERR_SHAPE), a bit width other than 8, 4 or 2 QD_ERR_SCHEME (the decode
    tiles' functions said QD_ERR_ARGUMENT), a row stride under the row QD_ERR_ARGUMENT
    (some said QD_ERR_SHAPE); past a kernel's own limit (M, N, K < 2^31) QD_ERR_SHAPE."""
    out = c_program_output(c_compiler, shell_env, tmp_path, """\
        char *const d = (char *)(uintptr_t)0x7f0000000000;  /* device addresses, never read */
        char *const e = d + (1 << 20), *const f = d + (2 << 20), *const g = d + (3 << 20);
        const int64_t most = INT64_MAX, past_int = (int64_t)1 << 31;
        const int bf = QD_CUDA_BF16;
        qd_status argument[] = {
            qd_cuda_int_matmul_s8((int8_t *)d, (int8_t *)e, most, 4, 16, 16, (int32_t *)f, NULL),
            qd_cuda_qq_matmul((int8_t *)d, (int8_t *)e, 2, most, 16, 16, (float *)g, 1, 16, (float *)f, 1, 16,
                              g + 4, QD_CUDA_F32, NULL),
            qd_cuda_fq_matmul(d, bf, 2, 64, e, f, 4, most, 64, 64, g, bf, NULL),
            qd_cuda_fq_tile_weights((int8_t *)d, 16, 64, 32, 4, e, NULL),
            qd_cuda_fq_expand_weights(d, 16, 64, 4, bf, e, 32, NULL),
            qd_cuda_split_bf16((float *)d, 2, 8, 4, e, 8, NULL),
            qd_cuda_scale_columns(d, bf, 2, 8, 4, (float *)e, (float *)f, 8, NULL),
            qd_cuda_pad_s8((int8_t *)d, 4, 16, (int8_t *)e, 8, NULL),
        };
        qd_status scheme[] = {
            qd_cuda_fq_tile_weights((int8_t *)d, 16, 64, 64, 3, e, NULL),
            qd_cuda_fq_untile_weights(d, 16, 64, 3, (int8_t *)e, 64, NULL),
            qd_cuda_fq_expand_weights(d, 16, 64, 3, bf, e, 64, NULL),
            qd_cuda_fq_matmul(d, bf, 2, 64, e, f, 3, 16, 64, 64, g, bf, NULL),
            qd_cuda_pack_u32((int8_t *)d, 4, 8, 3, (uint32_t *)e, NULL),
        };
        qd_status shape[] = {
            qd_cuda_int_matmul_s8((int8_t *)d, (int8_t *)e, past_int, 4, 16, 16, (int32_t *)f, NULL),
            qd_cuda_fq_matmul(d, bf, 1, 64, e, f, 4, past_int, 64, 64, g, bf, NULL),
            qd_cuda_fq_values(d, bf, past_int, 64, (int8_t *)e, 16, 64, 64, (float *)f, 1, 1, g, bf, NULL),
        };
        for (size_t i = 0; i < sizeof argument / sizeof argument[0]; i++)
            printf("%d ", argument[i]);
        printf("| ");
        for (size_t i = 0; i < sizeof scheme / sizeof scheme[0]; i++)
            printf("%d ", scheme[i]);
        printf("| ");
        for (size_t i = 0; i < sizeof shape / sizeof shape[0]; i++)
            printf("%d ", shape[i]);
    """)
    assert out == ["3"] * 8 + ["|"] + ["4"] * 5 + ["|"] + ["2"] * 3


def test_converting_nothing_takes_no_arrays(c_compiler, shell_env, tmp_path):
    """The header: n = 0 converts nothing and returns QD_OK, NULL pointers included."""
    out = c_program_output(c_compiler, shell_env, tmp_path, """\
        float one = 1.0f;
        uint16_t half;
        printf("%d %d %d %d %d ", qd_convert_f16_to_f32(NULL, 0, NULL), qd_convert_bf16_to_f32(NULL, 0, NULL),
               qd_convert_f32_to_f16(NULL, 0, NULL), qd_convert_f32_to_bf16(NULL, 0, NULL),
               qd_convert_f32_to_f16(&one, 1, NULL));
        const qd_status converted = qd_convert_f32_to_bf16(&one, 1, &half);
        printf("%d %x", converted, half);
    """)
    assert out == ["0", "0", "0", "0", "1", "0", "3f80"]


@pytest.mark.skipif(not built_with_cuda(), reason="the library was built without CUDA kernels")
def test_cuda_module_of_a_cuda_build_imports_gpu_or_not():
    """The CUDA module links the shipped library for its kernels and a CUDA runtime
    for its own calls; it imports wherever the package does, so that without a GPU
    the backend says there is none, not that it was built without CUDA."""
    import qdispatch._cuda  # noqa: F401
    if "cuda" not in qd.available_backends():
        with pytest.raises(qd.BackendUnavailableError, match="built with CUDA, but"):
            qd.tensor(np.zeros(4, np.float32), device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in qd.available_backends(), reason="needs the cuda backend and a GPU")
def test_shipped_library_runs_the_cuda_kernels(rng):
    """A build with CUDA ships its CUDA kernels in libqdispatch too: C code (here
    through ctypes, on torch's device memory) gets exact products from them, where
    the library used to hold only the stubs that report QD_ERR_CUDA_UNAVAILABLE."""
    import ctypes
    torch = pytest.importorskip("torch")
    lib = ctypes.CDLL(os.path.join(qd.get_library_dir(), "libqdispatch.so"))
    assert lib.qd_cuda_available() == 1
    M, K, N = 33, 80, 17  # rows 80 bytes apart: a multiple of 16
    a = rng.integers(-128, 128, (M, K), dtype=np.int8)
    bt = rng.integers(-128, 128, (N, K), dtype=np.int8)
    da, dbt = torch.from_numpy(a).cuda(), torch.from_numpy(bt).cuda()
    c = torch.zeros((M, N), dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    st = lib.qd_cuda_int_matmul_s8(ptr(da.data_ptr()), ptr(dbt.data_ptr()), i64(M), i64(N), i64(K), i64(K),
                                   ptr(c.data_ptr()), None)
    torch.cuda.synchronize()
    assert st == 0
    np.testing.assert_array_equal(c.cpu().numpy(), a.astype(np.int64) @ bt.T.astype(np.int64))


@pytest.mark.skipif(not any(map(os.path.exists, DOCS)), reason="docs not beside the tests")
def test_docs_show_the_tested_commands():
    texts = [Path(p).read_text() for p in DOCS if os.path.exists(p)]
    section = next((t for t in texts if "## Embedding from C" in t), None)
    assert section is not None, "no 'Embedding from C' section"
    for command in (BUILD_SHARED, BUILD_STATIC, BUILD_CMAKE):
        assert command in section
    assert CYTHON_EXT.split("\n", 1)[1] in section  # the Cython example is the one built below


CYTHON_EXT = textwrap.dedent("""\
    # cython: language_level=3
    cimport qdispatch
    from libc.stdint cimport int8_t, int32_t

    def kind_of(qdispatch.QTensor t):
        return t.kind  # the C field, no Python attribute lookup

    def int_matmul(const int8_t[:, ::1] a, const int8_t[:, ::1] b, int32_t[:, ::1] c):
        cdef qdispatch.qd_status st
        with nogil:
            st = qdispatch.qd_int_matmul_s8(&a[0, 0], a.shape[0], a.shape[1], &b[0, 0],
                                            b.shape[1], &c[0, 0])
        if st != qdispatch.QD_OK:
            raise RuntimeError(qdispatch.qd_status_string(st).decode())

    def cuda_available():
        return qdispatch.qd_cuda_available()  # 0 in a build without CUDA, or without a GPU
""")

CYTHON_SETUP = textwrap.dedent("""\
    from Cython.Build import cythonize
    from setuptools import Extension, setup
    import qdispatch

    lib = qdispatch.get_library_dir()
    ext = Extension("qd_embed", ["qd_embed.pyx"], include_dirs=[qdispatch.get_include()],
                    library_dirs=[lib], runtime_library_dirs=[lib], libraries=["qdispatch"])
    setup(ext_modules=cythonize([ext]))
""")


@pytest.fixture
def cython_ext(c_compiler, tmp_path, monkeypatch):
    pytest.importorskip("Cython")
    pytest.importorskip("setuptools")
    (tmp_path / "qd_embed.pyx").write_text(CYTHON_EXT)
    (tmp_path / "setup.py").write_text(CYTHON_SETUP)
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp_path,
                          capture_output=True, text=True, env=package_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    monkeypatch.syspath_prepend(str(tmp_path))
    import qd_embed
    yield qd_embed
    sys.modules.pop("qd_embed", None)


def test_cython_extension_cimports_qdispatch(cython_ext):
    a = np.full((3, 300), -128, np.int8)  # int16 saturation would show here
    a[1] = np.arange(300) % 255 - 127
    b = np.full((300, 5), -128, np.int8)
    c = np.zeros((3, 5), np.int32)
    cython_ext.int_matmul(a, b, c)
    np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64))

    w = np.ones((4, 4), np.float32)
    for device, kind in (("cpu", qd.BackendKind.CPU), ("reference", qd.BackendKind.REFERENCE)):
        assert cython_ext.kind_of(qd.quantize(w, qd.QuantScheme("q8s"), device=device)) == kind
    assert cython_ext.cuda_available() == ("cuda" in qd.available_backends())
