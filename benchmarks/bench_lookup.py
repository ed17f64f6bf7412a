"""Embedding lookups on the host: `qd.embedding(ids, table)` on the cpu backend (the C
kernel) and on the reference backend (numpy), beside a float32 lookup of the same
rows (torch's `nn.Embedding` where torch is installed, else numpy's `take`), all in
the same run:

    python -m pytest benchmarks/bench_lookup.py -q

Each --bench-shapes entry MxKxN is M ids into a table of N rows of K values (a
weight [N, K] read as a table).  Every call looks up fresh random ids from a pool
of ID_SETS sets, in copies of the table that together exceed the last-level cache
within --bench-rotation-mb (`bench.weight_copies`), so the rows a call reads were not
read just before.
extra_info's `ratio_float_lookup` is the float lookup's time over this case's
(above 1: faster than the float table)."""
import numpy as np
import pytest

import qdispatch as qd
from qdispatch import bench

SCHEMES = {"int8 per row": bench.W8, "int4 block 32": bench.W4}
IMPLS = ("float_lookup", "cpu", "reference")
ID_SETS = 4096  # ids drawn for each call in turn: a small pool's rows stay in the cache

_FLOAT_SECONDS = {}


def _float_lookups(tables, id_sets):
    """The float32 lookup a user would otherwise run: nn.Embedding if torch is here."""
    try:
        import torch
    except ImportError:
        return [lambda ids, t=t: np.take(t, ids, axis=0) for t in tables], id_sets, "numpy take"
    embs = [torch.nn.Embedding.from_pretrained(torch.from_numpy(t)) for t in tables]
    return embs, [torch.from_numpy(ids) for ids in id_sets], "torch nn.Embedding"


def _check_rows(rows, want, label):
    """The rows a lookup gave (a qdispatch or torch tensor, or an array) are `want`'s, bit for bit."""
    rows = np.asarray(rows.numpy() if hasattr(rows, "numpy") else rows)
    if not np.array_equal(rows, want):
        raise AssertionError(f"{label}: the lookup's rows differ from the reference's "
                             f"({np.count_nonzero(rows != want)} of {want.size} values)")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_lookup(benchmark, bench_shape, scheme, impl, rotation_budget_bytes):
    shape = bench_shape
    if shape.k % 32 and scheme == "int4 block 32":
        pytest.skip(f"int4 block 32 needs K a multiple of 32, got K={shape.k}")
    benchmark.group = f"lookup {shape.m} ids of [{shape.n}, {shape.k}], {scheme}"
    rng = np.random.default_rng(0)
    table = rng.standard_normal((shape.n, shape.k), dtype=np.float32)
    id_sets = [rng.integers(0, shape.n, shape.m) for _ in range(ID_SETS)]
    if impl == "float_lookup":
        nbytes = table.nbytes
        copies = bench.weight_copies(nbytes, rotation_budget_bytes)
        fns, args, name = _float_lookups([table] + [table.copy() for _ in range(copies - 1)], id_sets)
    else:
        first = qd.quantize(table, SCHEMES[scheme], device=impl)
        nbytes = first.nbytes
        copies = bench.weight_copies(nbytes, rotation_budget_bytes)
        qs = [first] + [qd.quantize(table, SCHEMES[scheme], device=impl) for _ in range(copies - 1)]
        fns = [lambda ids, q=q: qd.embedding(ids, q) for q in qs]
        args, name = id_sets, f"qd.embedding on {impl}"
    bench.warn_if_cached(benchmark.group, nbytes, copies)
    want = table if impl == "float_lookup" else first.to("reference").dequantize().numpy()
    for i, fn in enumerate(fns):  # every copy timed is checked once, before any timing
        _check_rows(fn(args[i % ID_SETS]), want[id_sets[i % ID_SETS]], f"{benchmark.group}, {name}, copy {i}")
    turn = iter(range(1 << 62))

    def call():
        i = next(turn)
        return fns[i % len(fns)](args[i % ID_SETS])
    call()
    benchmark(call)
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing timed
        return
    seconds = benchmark.stats.stats.min
    ratio, versus = bench.versus_contender(benchmark, seconds, impl, "float_lookup", _FLOAT_SECONDS)
    benchmark.extra_info.update(versus=f"{seconds * 1e6:.1f} us, {versus}", impl=name, us=seconds * 1e6, ratio_float_lookup=ratio,
                                table_copies=copies, rotated_bytes=nbytes * copies,
                                rotation_defeats_cache=bench.exceeds_cache(nbytes * copies),
                                rows_gbs=shape.m * shape.k * 4 / seconds / 1e9)
