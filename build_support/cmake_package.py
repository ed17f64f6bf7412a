"""The CMake package shipped beside the C library: `find_package(qdispatch)` with
`qdispatch_DIR` set to `qdispatch config --cmake` gives imported targets for the
shared and the static library.  Paths are found from the files' own folder, so a
moved install (a copied virtual environment) still configures."""
import os
import struct

CONFIG = """\
# qdispatch's CMake package, written when this copy of qdispatch was built.
#   find_package(qdispatch CONFIG REQUIRED)   # qdispatch_DIR: `qdispatch config --cmake`
#   target_link_libraries(app PRIVATE qdispatch::qdispatch)         # libqdispatch.so, its folder an rpath
#   target_link_libraries(app PRIVATE qdispatch::qdispatch_static)  # libqdispatch.a and what it needs
# qdispatch_WITH_CUDA says whether the libraries hold the CUDA kernels (without them
# the CUDA entry points return QD_ERR_CUDA_UNAVAILABLE).
if(CMAKE_VERSION VERSION_LESS 3.13)
  message(FATAL_ERROR "qdispatch's CMake package needs CMake 3.13 or later (INTERFACE_LINK_OPTIONS); "
                      "this is ${{CMAKE_VERSION}}. Use `qdispatch config --pc` with pkg_check_modules instead.")
endif()
get_filename_component(_qdispatch_root "${{CMAKE_CURRENT_LIST_DIR}}/../../.." ABSOLUTE)
set(qdispatch_INCLUDE_DIR "${{_qdispatch_root}}/include")
set(qdispatch_LIBRARY_DIR "${{_qdispatch_root}}/lib")
set(qdispatch_WITH_CUDA {with_cuda})
foreach(_qdispatch_file "${{qdispatch_INCLUDE_DIR}}/qdispatch.h" "${{qdispatch_LIBRARY_DIR}}/libqdispatch.so"
                        "${{qdispatch_LIBRARY_DIR}}/libqdispatch.a")
  if(NOT EXISTS "${{_qdispatch_file}}")
    set(qdispatch_FOUND FALSE)
    set(qdispatch_NOT_FOUND_MESSAGE "${{_qdispatch_file}} is missing: reinstall qdispatch (pip install --force-reinstall qdispatch)")
    return()
  endif()
endforeach()

{targets}unset(_qdispatch_root)
unset(_qdispatch_file)
"""

# Same major and minor version (0.x releases may change the C interface; its
# run-time check is qd_abi_version() == QD_ABI_VERSION).
VERSION = """\
# qdispatch's CMake package version, written when this copy of qdispatch was built.
set(PACKAGE_VERSION "{version}")
if(PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
elseif(NOT PACKAGE_FIND_VERSION_MAJOR STREQUAL "{major}" OR NOT PACKAGE_FIND_VERSION_MINOR STREQUAL "{minor}")
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
else()
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_FIND_VERSION STREQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
if(NOT CMAKE_SIZEOF_VOID_P STREQUAL "" AND NOT CMAKE_SIZEOF_VOID_P STREQUAL "{pointer_size}")
  math(EXPR _qdispatch_bits "{pointer_size} * 8")
  set(PACKAGE_VERSION "${{PACKAGE_VERSION}} (${{_qdispatch_bits}}-bit)")
  set(PACKAGE_VERSION_UNSUITABLE TRUE)
endif()
"""


TARGET = """\
if(NOT TARGET qdispatch::{name})
  add_library(qdispatch::{name} {kind} IMPORTED)
  set_target_properties(qdispatch::{name} PROPERTIES
    IMPORTED_LOCATION "${{qdispatch_LIBRARY_DIR}}/{file}"
    INTERFACE_INCLUDE_DIRECTORIES "${{qdispatch_INCLUDE_DIR}}"{properties})
endif()
"""


def imported_target(name, kind, file, **properties):
    lines = "".join(f'\n    {key} "{value}"' for key, value in properties.items() if value)
    return TARGET.format(name=name, kind=kind, file=file, properties=lines)


def write(lib_dir, version, openmp, cuda):
    """Writes lib_dir/cmake/qdispatch/: `openmp` whether the kernels use the OpenMP
    runtime, `cuda` the CUDA build's description (or None), whose runtime the static
    library then needs."""
    folder = os.path.join(lib_dir, "cmake", "qdispatch")
    os.makedirs(folder, exist_ok=True)
    libraries = ["m"] + (list(cuda["libraries"]) if cuda else [])
    # The shared target carries its folder as an rpath, as `config --libs` does: CMake's
    # own build rpath is dropped by `cmake --install`, and the installed program would
    # not find the library.
    targets = (imported_target("qdispatch", "SHARED", "libqdispatch.so", IMPORTED_SONAME="libqdispatch.so",
                               INTERFACE_LINK_OPTIONS="-Wl,-rpath,${qdispatch_LIBRARY_DIR}") +
               imported_target("qdispatch_static", "STATIC", "libqdispatch.a",
                               INTERFACE_LINK_DIRECTORIES=cmake_path(cuda["library_dir"]) if cuda else "",
                               INTERFACE_LINK_LIBRARIES=";".join(libraries),
                               INTERFACE_LINK_OPTIONS="-fopenmp" if openmp else ""))
    config = CONFIG.format(with_cuda="TRUE" if cuda else "FALSE", targets=targets)
    major, minor = version.split(".")[:2]
    versions = VERSION.format(version=version, major=major, minor=minor,
                              pointer_size=struct.calcsize("P"))
    for name, text in (("qdispatchConfig.cmake", config), ("qdispatchConfigVersion.cmake", versions)):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


def cmake_path(path):
    """A path inside a quoted CMake argument: backslashes, quotes and `$` escaped."""
    return path.replace("\\", "/").replace('"', '\\"').replace("$", "\\$")
