#!/usr/bin/env bash
# Compare this tree's speed against the committed baseline (small shapes, one
# thread, qdispatch's own cases only: contenders are context, not regressions):
# fails when any benchmark's mean is more than 25% slower.
#
#   benchmarks/compare.sh           compare; extra pytest arguments pass through
#   benchmarks/compare.sh --save    measure this tree and save it as the new baseline
#
# pytest-benchmark keeps runs per platform (benchmarks/baseline/Linux-CPython-3.11-64bit/);
# a baseline only means something on the machine that saved it, so save one first
# on yours.
set -euo pipefail
# Run from benchmarks/: `python -m` puts the working folder first on sys.path, and at the
# source root that is the unbuilt package, not the installed one.
cd "$(dirname "$0")"
args=(. -p no:cacheprovider -k "not (numpy_f32 or fbgemm or ort_ or read_bandwidth)"
      --bench-shapes 1x1024x1024,16x1024x1024 --bench-threads 1 --bench-bandwidth-mb 256
      --benchmark-max-time=0.25 --benchmark-storage=file://baseline)
if [[ "${1:-}" == "--save" ]]; then
    shift
    exec python -m pytest "${args[@]}" --benchmark-save=baseline "$@"
fi
exec python -m pytest "${args[@]}" --benchmark-compare --benchmark-compare-fail=mean:25% "$@"
