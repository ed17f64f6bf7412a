"""qdispatch.embedding: rows of a quantized table, dequantized, on every backend,
value for value what dequantize(weight)[ids] gives."""
import os

import numpy as np
import pytest

import qdispatch as qd

SCHEMES = [
    qd.QuantScheme("q8s", axis=0),                                 # per row (the usual table)
    qd.QuantScheme("q8s", axis=1),                                 # per column
    qd.QuantScheme("q8f"),                                         # per tensor
    qd.QuantScheme("q8s", block=(4, 16)),                          # blocks across rows too
    qd.QuantScheme("q4s", block=32, store="packed_u32", scale_dtype="f16"),
    qd.QuantScheme("q2f", block=(2, 64), store="packed_u32"),
]


def table(rng, rows, dim, scheme, device, transposed):
    """A quantized [rows, dim] table, stored as it is or as the transpose of a [dim, rows] one."""
    w = rng.standard_normal((rows, dim)).astype(np.float32)
    if not transposed:
        return qd.quantize(w, scheme, device=device)
    return qd.quantize(np.ascontiguousarray(w.T), scheme.with_(block=_swapped(scheme, (rows, dim)), axis=None),
                       device=device).T


def _swapped(scheme, shape):
    block = scheme.block_shape(shape)
    return (block[1], block[0])


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.value}-{s.block or s.axis}-{s.store}")
def test_rows_are_the_dequantized_rows(device, rng, scheme, transposed):
    w = table(rng, 96, 128, scheme, device, transposed)
    want = w.dequantize().numpy()
    ids = rng.integers(0, 96, (3, 7))
    ids[0, :3] = [0, 95, 0]  # both ends, and a repeat
    out = qd.embedding(ids, w)
    assert out.device == w.device and out.shape == (3, 7, 128) and out.dtype == "float32"
    np.testing.assert_array_equal(out.numpy(), want[ids])


@pytest.mark.parametrize("dim, scheme", [
    (100, qd.QuantScheme("q8s", axis=0)), (100, qd.QuantScheme("q4s", block=4, store="packed_u32")),
    (100, qd.QuantScheme("q2f", store="packed_u32")), (120, qd.QuantScheme("q4s", block=4, store="packed_u32")),
    (120, qd.QuantScheme("q2s", block=(1, 24), store="packed_u32")), (136, qd.QuantScheme("q8s", block=(1, 8))),
    (4, qd.QuantScheme("q8s", axis=0)), (8, qd.QuantScheme("q4s", block=8, store="packed_u32"))],
    ids=["100 per row", "100 int4 block 4", "100 int2", "120 int4 block 4", "120 int2 block 24", "136 int8 block 8",
         "4 per row", "8 int4 block 8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_of_any_length_and_blocks_of_any_width(device, rng, dim, scheme, dtype):
    """Rows whose values are no whole number of words or vectors (a value a thread on
    CUDA), scale blocks narrower than a thread's eight values, or not aligned to them,
    and rows so narrow that a CUDA block takes many at once."""
    w = table(rng, 333, dim, scheme, device, False)
    ids = rng.integers(0, 333, 700)
    np.testing.assert_array_equal(qd.embedding(ids, w, dtype=dtype).numpy(), qd.dequantize(w, dtype).numpy()[ids])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rows_in_16_bit_are_dequantize_in_16_bit(device, rng, dtype):
    w = table(rng, 40, 64, SCHEMES[4], device, False)
    ids = np.array([39, 2, 2, 17])
    out = qd.embedding(ids, w, dtype=dtype)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out.numpy(), qd.dequantize(w, dtype).numpy()[ids])


@pytest.mark.parametrize("ids", [5, np.int64(5), [5], [[1, 2], [3, 4]], np.array([7, 0], np.uint8),
                                 np.array([7, 0], np.int16), np.array([[1]], np.uint64)],
                         ids=["int", "np.int64", "list", "nested", "uint8", "int16", "uint64"])
def test_ids_of_any_integer_kind_and_shape(device, rng, ids):
    w = table(rng, 8, 32, SCHEMES[0], device, False)
    out = qd.embedding(ids, w)
    arr = np.asarray(ids)
    assert out.shape == arr.shape + (32,)
    np.testing.assert_array_equal(out.numpy(), w.dequantize().numpy()[arr])


def test_ids_from_a_tensor(device, rng):
    w = table(rng, 8, 32, SCHEMES[0], device, False)
    ids = qd.tensor(np.array([3, 1], np.int32))
    np.testing.assert_array_equal(qd.embedding(ids, w).numpy(), w.dequantize().numpy()[[3, 1]])


@pytest.mark.parametrize("ids", [[], np.zeros((2, 0), np.int32)], ids=["empty list", "empty 2-D"])
def test_no_ids_give_no_rows(device, rng, ids):
    w = table(rng, 8, 32, SCHEMES[0], device, False)
    out = qd.embedding(ids, w, dtype="bfloat16")
    assert out.shape == np.shape(ids) + (32,) and out.device == w.device and out.dtype == "bfloat16"


@pytest.mark.parametrize("ids, bad, at", [([0, 8], 8, (1,)), ([[0, 1], [-1, 2]], -1, (1, 0)),
                                          (np.array([2**63], np.uint64), 2**63, (0,)),
                                          # Python ints past int64 reach numpy as objects
                                          ([3, 2**70], 2**70, (1,)), ([[-2**70]], -2**70, (0, 0))])
def test_an_id_outside_the_table_is_an_error_that_names_it(device, rng, ids, bad, at):
    w = table(rng, 8, 32, SCHEMES[0], device, False)
    with pytest.raises(qd.OutOfRangeError, match=rf"embedding id {bad} at position \({at[0]},"
                                                 rf".*outside the table's 8 rows: ids must lie in \[0, 8\)"):
        qd.embedding(ids, w)
    assert issubclass(qd.OutOfRangeError, IndexError)


@pytest.mark.parametrize("ids, error, match", [
    ([1.0], TypeError, "ids must be integers, got float64"),
    ([True], TypeError, "ids must be integers, got bool"),
    ([2**70, 1.0], TypeError, "ids must be integers, got object"),
    ([2**70, True], TypeError, "ids must be integers, got object"),
    ("1", TypeError, "ids must be integers, got <U1"),
    ([[1, 2], [3]], qd.ShapeError, "ids must form an array of integers"),
    # empty, they were let through (as [] is, which numpy makes float64) to numpy's bare UFuncTypeError
    (np.array([], "U1"), TypeError, "ids must be integers, got <U1"),
    (np.array([], "datetime64[D]"), TypeError, r"ids must be integers, got datetime64\[D\]"),
    (np.array([], "S1"), TypeError, r"ids must be integers, got \|S1"),
])
def test_ids_that_are_no_integers_are_refused(rng, ids, error, match):
    w = table(rng, 8, 32, SCHEMES[0], "cpu", False)
    with pytest.raises(error, match=match):
        qd.embedding(ids, w)


def test_the_table_must_be_a_2d_qtensor(rng):
    w = rng.standard_normal((8, 32)).astype(np.float32)
    with pytest.raises(TypeError, match="weight must be a QTensor .quantize the table first., got ndarray"):
        qd.embedding([1], w)
    w3 = qd.quantize(rng.standard_normal((2, 8, 32)).astype(np.float32), qd.QuantScheme("q8s", block=32))
    with pytest.raises(qd.ShapeError, match=r"2-D table \[num_embeddings, dim\], got a QTensor of shape \(2, 8, 32\)"):
        qd.embedding([1], w3)
    with pytest.raises(TypeError, match="Unsupported dtype 'float64'"):
        qd.embedding([1], qd.quantize(w, qd.QuantScheme("q8s", axis=0)), dtype="float64")


@pytest.mark.cuda
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.value}-{s.block or s.axis}-{s.store}")
def test_a_table_tied_to_the_output_layer_on_cuda(rng, monkeypatch, scheme, transposed):
    """A table that is also the output layer (tied embeddings): once the decode kernel
    laid it out, its store is freed, and its rows are read from the decode tiles
    (qd_cuda_fq_dequantize_rows), the rest of the table untouched.  1000 rows and 320
    columns leave part-filled tiles at the ends of both."""
    from qdispatch.backends import cuda
    w = table(rng, 1000, 320, scheme, "cuda", transposed)
    want = {dtype: qd.dequantize(w, dtype).numpy() for dtype in ("float32", "bfloat16")}
    x = qd.tensor(rng.standard_normal((1, 320)).astype(np.float32), device="cuda")
    qd.q_matmul(x, w.T, out_dtype="bfloat16")  # the decode kernel: lays out w's tiles
    # a scale per column (per value along K) too: x takes it, the tiles hold the values
    assert not w.storage.holds_values

    def untile(*args):
        raise AssertionError("the lookup rebuilt the whole table from its tiles")
    monkeypatch.setattr(cuda._cuda, "fq_untile_weights", untile)
    ids = rng.integers(0, 1000, 3000)
    for dtype in want:
        np.testing.assert_array_equal(qd.embedding(ids, w, dtype=dtype).numpy(), want[dtype][ids])


@pytest.mark.cuda
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.value}-{s.block or s.axis}-{s.store}")
def test_dequantize_of_a_tied_table_reads_its_tiles_on_cuda(rng, monkeypatch, scheme, transposed):
    """The whole table dequantized once the decode kernel laid it out (its store
    freed): the reference's values in every dtype, read from the tiles as lookups
    read them, with no copy of the store rebuilt."""
    from qdispatch.backends import cuda
    w = table(rng, 1000, 320, scheme, "cuda", transposed)
    spec = w.to("reference")
    x = qd.tensor(rng.standard_normal((1, 320)).astype(np.float32), device="cuda")
    qd.q_matmul(x, w.T, out_dtype="bfloat16")

    def untile(*args):
        raise AssertionError("dequantize rebuilt the table's store from its tiles")
    if not w.storage.holds_values:
        monkeypatch.setattr(cuda._cuda, "fq_untile_weights", untile)
    for dtype in ("float32", "bfloat16", "float16"):
        out = w.dequantize(dtype)
        assert out.dtype == dtype
        np.testing.assert_array_equal(out.numpy(), spec.dequantize(dtype).numpy())


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", [SCHEMES[1], qd.QuantScheme("q4s", block=(32, 1), store="packed_u32")],
                         ids=["int8", "int4"])
def test_a_table_laid_out_along_its_columns(rng, scheme):
    """A table whose columns the decode kernel streamed (x @ table, table [K, N], its
    scales in blocks along K): its tiles hold columns, so a lookup rebuilds the rows
    from them, same values."""
    w = table(rng, 256, 96, scheme, "cuda", False)
    want = w.dequantize().numpy()
    x = qd.tensor(rng.standard_normal((1, 256)).astype(np.float32), device="cuda")
    qd.q_matmul(x, w, out_dtype="bfloat16")
    assert not w.storage.holds_values
    ids = rng.integers(0, 256, 300)
    np.testing.assert_array_equal(qd.embedding(ids, w).numpy(), want[ids])


@pytest.mark.cuda
def test_the_c_entry_point_gives_nan_rows_for_ids_outside():
    """qd_cuda_dequantize_rows (what qdispatch.embedding runs on cuda) on ids checked by
    nobody: a row of NaN for an id outside the table, never another row's values."""
    import ctypes
    torch = pytest.importorskip("torch")
    lib = ctypes.CDLL(os.path.join(qd.get_library_dir(), "libqdispatch.so"))
    values = torch.arange(-8, 8, dtype=torch.int8, device="cuda").reshape(4, 4)
    scales = torch.tensor([[0.5], [1.0]], device="cuda")  # blocks of 2 rows x 4 columns
    ids = torch.tensor([3, -1, 2**32, 0], dtype=torch.int64, device="cuda")  # 2^32: no row 0 cut to 32 bits
    out = torch.zeros((4, 4), device="cuda")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    torch.cuda.synchronize()
    st = lib.qd_cuda_dequantize_rows(ptr(values.data_ptr()), 0, i64(4), i64(4), ptr(scales.data_ptr()), i64(2),
                                     i64(4), ptr(ids.data_ptr()), i64(4), ptr(out.data_ptr()), 0, None)  # QD_CUDA_F32
    torch.cuda.synchronize()
    assert st == 0
    got = out.cpu().numpy()
    np.testing.assert_array_equal(got[0], [4.0, 5.0, 6.0, 7.0])
    np.testing.assert_array_equal(got[3], [-4.0, -3.5, -3.0, -2.5])
    assert np.isnan(got[1:3]).all()


@pytest.mark.cuda
@pytest.mark.parametrize("out_dtype, name", [(0, "float32"), (2, "bfloat16")])  # QD_CUDA_F32, QD_CUDA_BF16
def test_the_c_entry_point_reads_and_writes_at_any_alignment(rng, out_dtype, name):
    """Eight values a thread need an output row of whole 16-byte stores (and int8
    values in whole 8 bytes); int8 values or an output a few bytes off that take a
    value a thread: same rows."""
    import ctypes
    torch = pytest.importorskip("torch")
    lib = ctypes.CDLL(os.path.join(qd.get_library_dir(), "libqdispatch.so"))
    dtype = getattr(torch, name)
    q = rng.integers(-127, 128, (9, 64)).astype(np.int8)
    s = rng.uniform(0.5, 2.0, (9, 8)).astype(np.float32)  # blocks of 1 x 8
    want = torch.from_numpy(q.astype(np.float32) * np.repeat(s, 8, axis=1)).to(dtype)
    ids = torch.tensor([8, 0, 3, 3], dtype=torch.int64, device="cuda")
    scales = torch.from_numpy(s).cuda()
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for values_at, out_at in ((0, 0), (4, 0), (0, 2), (3, 1)):
        values = torch.zeros(q.size + values_at, dtype=torch.int8, device="cuda")
        values[values_at:] = torch.from_numpy(q.ravel()).cuda()
        out = torch.zeros(4 * 64 + out_at, dtype=dtype, device="cuda")
        torch.cuda.synchronize()
        st = lib.qd_cuda_dequantize_rows(ptr(values.data_ptr() + values_at), 0, i64(9), i64(64),
                                         ptr(scales.data_ptr()), i64(1), i64(8), ptr(ids.data_ptr()), i64(4),
                                         ptr(out[out_at:].data_ptr()), out_dtype, None)
        torch.cuda.synchronize()
        assert st == 0
        assert torch.equal(out[out_at:].reshape(4, 64).cpu(), want[ids.cpu()]), (values_at, out_at)


HOST_SCHEMES = SCHEMES + [
    qd.QuantScheme("q8s", block=(1, 8)),                                # blocks narrower than a run of one scale
    qd.QuantScheme("q4f", block=(3, 1), store="packed_u32"),            # a scale per value along a row
    qd.QuantScheme("q8f", block=(1, 640), store="packed_u32"),          # 8-bit values packed four a word
]


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("scheme", HOST_SCHEMES, ids=lambda s: f"{s.value}-{s.block or s.axis}-{s.store}")
def test_cpu_lookups_and_dequantize_are_the_reference_bit_for_bit(rng, scheme, transposed):
    """The cpu backend dequantizes in C (qd_dequantize_rows): rows longer than its
    512-column chunks with a ragged end, every width and blocking, each dtype: the
    reference backend's bits."""
    w = table(rng, 96, 1280, scheme, "cpu", transposed)
    spec = w.to("reference")
    ids = rng.integers(0, 96, 50)
    for dtype in ("float32", "float16", "bfloat16"):
        np.testing.assert_array_equal(w.dequantize(dtype).numpy(), spec.dequantize(dtype).numpy())
        np.testing.assert_array_equal(qd.embedding(ids, w, dtype=dtype).numpy(),
                                      qd.embedding(ids, spec, dtype=dtype).numpy())


@pytest.mark.parametrize("shape, scheme", [
    ((2, 6, 40), qd.QuantScheme("q8s", block=(1, 2, 8))),
    ((3, 4, 64), qd.QuantScheme("q4s", block=(1, 1, 32), store="packed_u32")),
    ((4, 8), qd.QuantScheme("q8f")),
    ((70,), qd.QuantScheme("q2s", block=(10,), store="packed_u32")),
    ((2, 3, 16), qd.QuantScheme("q8s", block=(2, 1, 16))),  # a blocking no 2-D view holds: numpy's path
], ids=["3-D blocks across rows", "3-D int4", "per tensor", "1-D int2", "N-d blocking"])
def test_cpu_dequantize_of_any_rank_is_the_reference(rng, shape, scheme):
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    q = qd.quantize(x, scheme, device="cpu")
    for dtype in ("float32", "bfloat16"):
        out = q.dequantize(dtype)
        assert out.shape == shape and out.dtype == dtype
        np.testing.assert_array_equal(out.numpy(), q.to("reference").dequantize(dtype).numpy())


@pytest.mark.parametrize("scheme", [
    qd.QuantScheme("q8s", axis=0),
    qd.QuantScheme("q4s", block=(1, 32), store="packed_u32"),
    qd.QuantScheme("q2f", block=(1, 64), store="packed_u32"),
    qd.QuantScheme("q8f", block=(2, 128), scale_dtype="bf16"),
], ids=lambda s: f"{s.value}-{s.block or s.axis}")
def test_cpu_weight_dequantizes_from_its_panels_as_the_reference(rng, scheme):
    """A weight quantized on cpu keeps only its panels; dequantize reads them in place,
    a few rows at a time (keeping no int8 copy), and gives the reference's bits in each
    dtype, through a transposed view too."""
    w = qd.quantize((rng.standard_normal((70, 384)) * 2).astype(np.float32), scheme, device="cpu")
    assert not w.storage.holds_values
    spec = w.to("reference")
    for q, ref in ((w, spec), (w.T, spec.T)):
        for dtype in ("float32", "float16", "bfloat16"):
            got, want = (np.ascontiguousarray(t.dequantize(dtype).numpy()) for t in (q, ref))
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # signed zeros too
    assert not w.storage.holds_values


def test_cpu_dequantize_at_the_ends_of_float_ranges(rng):
    """Products at float32's largest stay finite in float32 and overflow the 16-bit
    dtypes to inf, and tiny ones round to float16's subnormals or to zero, as the
    reference gives them (products past float32's range can't be made: see
    test_q_matmul.py)."""
    values = rng.integers(-128, 128, (4, 64)).astype(np.int8)
    values[0, :2] = [-128, 127]
    scales = np.array([[2.65e36], [1e-45], [3e-8], [6e-5]], np.float32)  # 128 x 2.65e36: 3.39e38
    q = qd.qtensor_from_parts(values, scales, qd.QuantScheme("q8f", axis=0), device="cpu")
    for dtype in ("float32", "float16", "bfloat16"):
        got, want = q.dequantize(dtype).numpy(), q.to("reference").dequantize(dtype).numpy()
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # signed zeros too
    assert np.isfinite(q.dequantize().numpy()).all()
    assert np.isinf(q.dequantize("float16").numpy()[0, :2]).all()


def _host_entry_point():
    import ctypes
    lib = ctypes.CDLL(os.path.join(qd.get_library_dir(), "libqdispatch.so"))
    f = lib.qd_dequantize_rows
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    return lambda *args: f(*(a.ctypes.data if isinstance(a, np.ndarray) else a for a in args))


def test_the_host_c_entry_point_refuses_ids_outside_before_writing():
    """qd_dequantize_rows from C, ids checked by nobody: QD_ERR_ARGUMENT (3), the
    output untouched; good ids give the rows."""
    call = _host_entry_point()
    values = np.arange(-8, 8, dtype=np.int8).reshape(4, 4)
    scales = np.array([[0.5], [1.0]], np.float32)  # blocks of 2 rows x 4 columns
    out = np.full((3, 4), 7.0, np.float32)
    for bad in (-1, 4, 2**32):
        ids = np.array([3, bad, 0], np.int64)
        assert call(values, 0, 4, 4, scales, 2, 4, ids, 3, out, 0) == 3
        assert (out == 7.0).all()
    assert call(values, 0, 4, 4, scales, 2, 4, np.array([3, 1, 0], np.int64), 3, out, 0) == 0
    np.testing.assert_array_equal(out, [[4, 5, 6, 7], [-2, -1.5, -1, -0.5], [-4, -3.5, -3, -2.5]])


@pytest.mark.parametrize("args, status", [
    (dict(values=None), 1), (dict(out=None), 1),               # QD_ERR_NULL
    (dict(bits=3), 4), (dict(out_dtype=5), 3),                 # QD_ERR_SCHEME, QD_ERR_ARGUMENT
    (dict(block_cols=3), 2), (dict(rows=0), 2), (dict(n=5), 2),  # QD_ERR_SHAPE: no ids and n != rows
    (dict(out="values"), 3),                                   # out over the values
], ids=["no values", "no out", "3 bits", "dtype 5", "block 3", "no rows", "n past rows", "overlap"])
def test_the_host_c_entry_point_refuses_bad_arguments(args, status):
    call = _host_entry_point()
    values = np.ones((4, 4), np.int8)
    a = dict(values=values, bits=0, rows=4, cols=4, scales=np.ones((2, 1), np.float32), block_rows=2,
             block_cols=4, ids=None, n=4, out=np.zeros((4, 4), np.float32), out_dtype=0)
    a.update(args)
    if isinstance(a["out"], str):
        a["out"] = values
    assert call(*a.values()) == status
