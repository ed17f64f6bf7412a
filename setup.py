"""Build qdispatch: the C kernel library, the Cython extensions, and (when a CUDA
toolkit is found) the CUDA backend.  `pip install .` runs all of it."""
import glob
import json
import os
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_support import cmake_package  # noqa: E402
from build_support import cpu as cpu_build  # noqa: E402
from build_support import cuda as cuda_build  # noqa: E402
from build_support.link import without_run_paths  # noqa: E402

ROOT = "."  # setup.py runs from the project root; relative paths keep build dirs tidy
INCLUDE = os.path.join("src_c", "include")
try:
    CUDA = cuda_build.configure(cpu_build.cross_target())
except cuda_build.BuildSettingError as err:
    sys.exit(f"error: {err}")  # what to set, without a traceback around it
# Relink the extensions whenever a kernel source or header changes.
C_SOURCES = sorted(glob.glob("src_c/**/*.[ch]", recursive=True))


def extensions():
    common = dict(include_dirs=[INCLUDE, "qdispatch"], language="c")
    exts = [
        Extension("qdispatch._core", ["qdispatch/_core.pyx"], **common),
        Extension("qdispatch._cpu", ["qdispatch/_cpu.pyx"], depends=C_SOURCES, **common),
    ]
    if CUDA is not None:
        exts.append(CUDA.extension(common))
    from Cython.Build import cythonize
    return cythonize(exts, language_level=3, compiler_directives={"embedsignature": True})


class BuildExt(build_ext):
    """Compiles the kernel library once and ships it (static + shared, with its
    header) inside the package for C embedding.  The CPU extension links the CPU
    kernels' objects; the CUDA extension links the shipped shared library for the
    CUDA kernels (tens of MB for all targets) rather than hold a copy of its own."""

    def build_extensions(self):
        for linker in ("linker_so", "linker_so_cxx"):
            if getattr(self.compiler, linker, None):
                setattr(self.compiler, linker, without_run_paths(getattr(self.compiler, linker)))
        self.kernel_objects = cpu_build.compile_objects(self.compiler, ROOT, self.build_temp)
        self.cuda = CUDA
        cuda_objects = cuda_build.compile_or_skip(CUDA, self.build_temp) if CUDA is not None else []
        self.cuda_objects = cuda_objects or []
        if cuda_objects is None:  # nvcc failed under QDISPATCH_CUDA=auto: build without the backend
            self.cuda = None
            self.extensions = [ext for ext in self.extensions if ext.name != "qdispatch._cuda"]
        if self.cuda is None:  # an earlier build's module would ship (or import) in its place
            stale = self.get_ext_fullpath("qdispatch._cuda")
            if os.path.exists(stale):
                os.remove(stale)
        self.ship_c_library()  # first: the CUDA extension links it
        for ext in self.extensions:
            if ext.name == "qdispatch._cpu":
                cpu_build.link_objects(ext, self.cpu_objects())
                ext.extra_link_args = cpu_build.openmp_flags()  # known once the compiler was probed
            elif ext.name == "qdispatch._cuda":
                lib_dir = os.path.join(self.package_dirs()[0], "lib")
                ext.library_dirs = [lib_dir] + ext.library_dirs
                ext.depends = list(ext.depends) + [os.path.join(lib_dir, "libqdispatch.so")]  # relinked with it
        super().build_extensions()
        self.write_build_config()

    def run(self):
        super().run()
        if self.inplace:  # setuptools copies only the extensions back to the source tree
            for name in ("lib", "include"):
                shutil.copytree(os.path.join(self.build_lib, "qdispatch", name),
                                os.path.join("qdispatch", name), dirs_exist_ok=True)
            shutil.copy(os.path.join(self.build_lib, "qdispatch", "_build_config.py"), "qdispatch")

    def package_dirs(self):
        return [os.path.join(self.build_lib, "qdispatch")]

    def ship_c_library(self):
        for pkg in self.package_dirs():
            self.ship_c_library_to(pkg)

    def cpu_objects(self):
        """The CPU kernels, with the stubs of the CUDA entry points when CUDA was not built."""
        if self.cuda is None:
            return self.kernel_objects
        return [o for o in self.kernel_objects if os.path.basename(o) != "cuda_stubs.o"]

    def c_library_objects(self):
        """The shipped library's objects, and what linking the CUDA ones needs."""
        if self.cuda is None:
            return self.kernel_objects, {}
        return (self.cpu_objects() + self.cuda_objects,
                dict(libraries=cuda_build.LIBRARIES, library_dirs=[self.cuda.library_dir]))

    def ship_c_library_to(self, pkg):
        lib_dir = os.path.join(pkg, "lib")
        inc_dir = os.path.join(pkg, "include")
        os.makedirs(lib_dir, exist_ok=True)
        os.makedirs(inc_dir, exist_ok=True)
        objects, cuda_link = self.c_library_objects()
        archive = os.path.join(lib_dir, self.compiler.library_filename("qdispatch"))
        if os.path.exists(archive):  # ar adds to an archive: an earlier build's members would stay
            os.remove(archive)
        self.compiler.create_static_lib(objects, "qdispatch", output_dir=lib_dir)
        self.compiler.link_shared_object(
            objects, os.path.join(lib_dir, "libqdispatch.so"), **cuda_link,
            # -Bsymbolic: its own functions call each other, whatever else the process loaded;
            # nodelete: dlclose would unload the OpenMP runtime under its idle worker threads
            extra_postargs=cpu_build.openmp_flags() + ["-Wl,-soname,libqdispatch.so", "-Wl,-Bsymbolic",
                                                       "-Wl,-z,nodelete"])
        shutil.copy(os.path.join(INCLUDE, "qdispatch.h"), inc_dir)
        cmake_package.write(lib_dir, self.distribution.get_version(), openmp=not cpu_build.openmp_left_out(),
                            cuda=self.cuda.describe() if self.cuda is not None else None)

    def write_build_config(self):
        config = {
            "compiler": " ".join(self.compiler.compiler_so[:1]),
            # Python's own and the environment's (CFLAGS, CPPFLAGS): every file gets them, ahead of ours
            "compiler_flags": self.compiler.compiler_so[1:],
            "machine": cpu_build.machine(),
            "flags_by_isa": cpu_build.flags_by_isa(),
            "isas_left_out": cpu_build.left_out(),
            "openmp_left_out": cpu_build.openmp_left_out(),
            "cuda": self.cuda.describe() if self.cuda is not None else None,
            "cuda_skipped_reason": cuda_build.skipped_reason() if self.cuda is None else None,
        }
        text = ('"""Written by setup.py: how this copy of qdispatch was built."""\n'
                "import json\n\nBUILD_CONFIG = json.loads(%r)\n" % json.dumps(config))
        for pkg in self.package_dirs():
            with open(os.path.join(pkg, "_build_config.py"), "w") as f:
                f.write(text)


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
