#!/usr/bin/env bash
# Compare this tree's speed against the committed baseline (small shapes, one
# thread, qdispatch's own cases only: contenders are context, not regressions; weight
# copies of at most 1 GiB a case, which is 16x a 64 MiB last-level cache, so a CPU with a
# larger one reads some from cache, alike in both runs, rather than holding many GiB):
# fails when any benchmark's median time is more than 25% slower (the median: the
# mean moves with a shared machine's neighbours, and the best call with luck, a weight
# copy still in a last-level cache larger than the copies' 1 GiB allows for, which
# made an unchanged build fail against its own baseline).
#
#   benchmarks/compare.sh           compare; extra pytest arguments pass through (-k narrows the cases)
#   benchmarks/compare.sh --save    measure this tree and save it as the new baseline
#
# pytest-benchmark keeps runs per platform (benchmarks/baseline/Linux-CPython-3.11-64bit/);
# a baseline only means something on the machine that saved it, so a baseline of
# another CPU is refused: save one first on yours.  A run that compares nothing
# (every case renamed, other options) fails too, rather than passing unchecked.
set -euo pipefail
# Run from benchmarks/: `python -m` puts the working folder first on sys.path, and at the
# source root that is the unbuilt package, not the installed one.
cd "$(dirname "$0")"
# --rootdir: the cases' full names are the baseline's (benchmarks/bench_cpu.py::...) wherever
# this folder sits; pytest-benchmark pairs runs by them
ours="not (numpy_f32 or fbgemm or ort_ or read_bandwidth or float_lookup or float32_copy)"
# a -k of the caller's narrows that filter (pytest keeps only the last -k, which would
# bring the contenders back)
extra=()
while [ $# -gt 0 ]; do
    case $1 in
        -k) ours="($ours) and ($2)"; shift 2 ;;
        -k*) ours="($ours) and (${1#-k})"; shift ;;
        *) extra+=("$1"); shift ;;
    esac
done
set -- ${extra[@]+"${extra[@]}"}
args=(. --rootdir=.. -p no:cacheprovider -k "$ours"
      --bench-shapes 1x1024x1024,16x1024x1024 --bench-threads 1 --bench-bandwidth-mb 256
      --bench-rotation-mb 1024 --benchmark-max-time=0.25)
if [[ "${1:-}" == "--save" ]]; then
    shift
    # measured into a folder of its own: a run that fails or is interrupted leaves the
    # baseline as it was, rather than a partial run that would become the latest
    fresh=$(mktemp -d)
    trap 'rm -rf "$fresh"' EXIT
    python -m pytest "${args[@]}" --benchmark-storage="file://$fresh" --benchmark-save=baseline "$@"
    saved=$(ls "$fresh"/*/*_baseline.json)
    platform=$(basename "$(dirname "$saved")")
    # the new run replaces the old ones: `--benchmark-compare` takes the latest, but a
    # folder of stale runs misleads whoever reads it
    find baseline -name '*_baseline.json' -delete 2>/dev/null || true
    mkdir -p "baseline/$platform"
    mv "$saved" "baseline/$platform/"
    exit 0
fi
args+=(--benchmark-storage=file://baseline)
run=$(mktemp)
trap 'rm -f "$run"' EXIT
# the baseline's machine against this one (pytest-benchmark only warns)
python - <<'PY'
import glob, json, sys
import cpuinfo
from pytest_benchmark.utils import get_machine_id
saved = sorted(glob.glob("baseline/*/*_baseline.json"))
if not saved:
    sys.exit("compare.sh: no baseline saved in benchmarks/baseline: run benchmarks/compare.sh --save first")
here = sorted(glob.glob(f"baseline/{get_machine_id()}/*_baseline.json"))
if not here:  # pytest-benchmark compares only within its platform's folder
    sys.exit(f"compare.sh: the baseline ({saved[-1]}) was saved by another Python or platform than this "
             f"one ({get_machine_id()}): save your own with benchmarks/compare.sh --save, then compare.")
def cpu(info):
    return {k: info.get(k) for k in ("brand_raw", "family", "model", "count")}
then, now = cpu(json.load(open(here[-1]))["machine_info"]["cpu"]), cpu(cpuinfo.get_cpu_info())
if then != now:
    sys.exit(f"compare.sh: the baseline was saved on another CPU ({then}; this one is {now}): its times say "
             f"nothing about this machine. Save your own with benchmarks/compare.sh --save, then compare.")
import qdispatch as qd  # the cases' names don't carry the ISA: a forced one, or a build without one, would pass
isa_then = json.load(open(here[-1]))["machine_info"].get("qdispatch", {}).get("isa")
isa_now = qd.info()["backends"].get("cpu", {}).get("isa")
if isa_then and isa_then != isa_now:
    sys.exit(f"compare.sh: the baseline ran the cpu backend's {isa_then} kernels and this run would run "
             f"{isa_now} (QDISPATCH_ISA, or a build without them): its times would compare other kernels")
PY
status=0
python -m pytest "${args[@]}" --benchmark-compare --benchmark-compare-fail=median:25% --benchmark-json="$run" "$@" \
    || status=$?
[ "$status" -eq 0 ] || [ -s "$run" ] || exit "$status"  # pytest stopped before measuring: its message says why
# a comparison that left out some of the baseline's cases did not check them (a build
# that lost an ISA, other shapes, threads or names)
python - "$run" <<'PY' || status=1
import glob, json, sys
from pytest_benchmark.utils import get_machine_id
# by full name, as pytest-benchmark pairs them: a case of the same name under another path was not compared
base = {b["fullname"] for b in json.load(open(sorted(glob.glob(f"baseline/{get_machine_id()}/*_baseline.json"))[-1]))["benchmarks"]}
ran = {b["fullname"] for b in json.load(open(sys.argv[1]))["benchmarks"]} if open(sys.argv[1]).read(1) else set()
if not base <= ran:
    left = sorted(base - ran)
    sys.exit(f"compare.sh: {len(left)} of the baseline's {len(base)} cases were not run, so they were not "
             f"compared ({', '.join(left[:5])}{', ...' if len(left) > 5 else ''}): run with the options the "
             f"baseline was saved with, or save a new one")
PY
exit $status
