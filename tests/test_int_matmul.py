"""int_matmul: exact int8 x int8 -> int32 on every backend."""
import numpy as np
import pytest

import qdispatch as qd

EDGE = [1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97, 127]


def python_int_matmul(a, b):
    """Arbitrary-precision integers: the arithmetic no kernel can fake."""
    return np.array([[sum(int(x) * int(y) for x, y in zip(row, col)) for col in b.T] for row in a],
                    dtype=np.int64)


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (1, 17, 5), (3, 33, 2), (17, 16, 31), (1, 64, 65),
                                   (5, 97, 13), (2, 127, 3), (4, 1, 7)])
def test_against_python_ints(device, rng, m, k, n):
    a = rng.integers(-128, 128, size=(m, k), dtype=np.int8)
    b = rng.integers(-128, 128, size=(k, n), dtype=np.int8)
    out = qd.int_matmul(qd.tensor(a, device=device), qd.tensor(b, device=device))
    assert out.dtype == "int32" and out.device == device
    np.testing.assert_array_equal(out.numpy(), python_int_matmul(a, b))


@pytest.mark.parametrize("m,k,n", [(1, 64, 16), (3, 33, 17), (17, 100, 5), (2, 7, 300)])
def test_a_weight_in_linear_layout_seen_transposed(device, rng, m, k, n):
    """b = w.T for an int8 w [N, K]: a view that the cpu backend packs from w's rows."""
    a = rng.integers(-128, 128, size=(m, k), dtype=np.int8)
    w = rng.integers(-128, 128, size=(n, k), dtype=np.int8)
    for b in (w.T, qd.tensor(w, device=device).T):
        np.testing.assert_array_equal(qd.int_matmul(qd.tensor(a, device=device), b).numpy(), python_int_matmul(a, w.T))
    half = k // 2 or 1  # columns of w: a strided view, copied as before
    np.testing.assert_array_equal(qd.int_matmul(a[:, :half], w[:, :half].T).numpy(),
                                  python_int_matmul(a[:, :half], w[:, :half].T))


@pytest.mark.parametrize("size", EDGE)
def test_tile_and_tail_sizes(device, rng, size):
    for m, k, n in [(size, 33, 17), (3, size, 5), (2, 31, size)]:
        a = rng.integers(-128, 128, size=(m, k), dtype=np.int8)
        b = rng.integers(-128, 128, size=(k, n), dtype=np.int8)
        want = a.astype(np.int64) @ b.astype(np.int64)
        np.testing.assert_array_equal(qd.int_matmul(qd.tensor(a, device=device),
                                                    qd.tensor(b, device=device)).numpy(), want)


@pytest.mark.parametrize("pattern", ["all_min", "alternating", "min_times_max"])
def test_extreme_values(device, pattern):
    m, k, n = 5, 4099, 7
    if pattern == "all_min":
        a = np.full((m, k), -128, np.int8)
        b = np.full((k, n), -128, np.int8)
    elif pattern == "alternating":
        a = np.where(np.arange(m * k).reshape(m, k) % 2, 127, -128).astype(np.int8)
        b = np.where(np.arange(k * n).reshape(k, n) % 3, -128, 127).astype(np.int8)
    else:
        a = np.full((m, k), -128, np.int8)
        b = np.full((k, n), 127, np.int8)
    want = a.astype(np.int64) @ b.astype(np.int64)
    np.testing.assert_array_equal(qd.int_matmul(qd.tensor(a, device=device),
                                                qd.tensor(b, device=device)).numpy(), want)


def test_largest_exact_k(device):
    k = 131071
    a = np.full((1, k), -128, np.int8)
    b = np.full((k, 2), -128, np.int8)
    out = qd.int_matmul(qd.tensor(a, device=device), qd.tensor(b, device=device)).numpy()
    np.testing.assert_array_equal(out, [[k * 16384, k * 16384]])


@pytest.mark.parametrize("k", [131072, 2 * 65536 + 77, 3 * 65536])
def test_k_past_int32s_exact_range_sums_in_pieces(device, rng, k):
    """Past K = 131071 the int32 sums are of pieces of K, added in int64: exact, and
    an int32 result wherever the sums fit; a sum past int32 is refused by position."""
    a = rng.integers(-128, 128, size=(2, 3, k), dtype=np.int8)  # batched, as other K are
    b = rng.integers(-128, 128, size=(k, 5), dtype=np.int8)
    out = qd.int_matmul(qd.tensor(a, device=device), qd.tensor(b, device=device))
    assert out.dtype == "int32" and out.shape == (2, 3, 5)
    np.testing.assert_array_equal(out.numpy(), a.astype(np.int64) @ b.astype(np.int64))
    top = np.full((1, k), -128, np.int8)
    cols = np.full((k, 2), -128, np.int8)
    cols[1:, 1] = 0  # the sum at (0, 1) fits, the one at (0, 0) does not
    with pytest.raises(qd.ShapeError, match=rf"int_matmul's sum at \(0, 0\) over K={k} is {k * 16384}, past "
                                            r"the int32 it returns: split K"):
        qd.int_matmul(qd.tensor(top, device=device), qd.tensor(cols, device=device))


def test_vector_and_batch_shapes(device, rng):
    a = rng.integers(-128, 128, size=(3, 2, 5, 9), dtype=np.int8)
    b = rng.integers(-128, 128, size=(2, 9, 4), dtype=np.int8)
    out = qd.int_matmul(qd.tensor(a, device=device), qd.tensor(b, device=device))
    assert out.shape == (3, 2, 5, 4)
    np.testing.assert_array_equal(out.numpy(), a.astype(np.int64) @ b.astype(np.int64))
    v = rng.integers(-128, 128, size=(9,), dtype=np.int8)
    np.testing.assert_array_equal(qd.int_matmul(qd.tensor(v, device=device), qd.tensor(b[0], device=device)).numpy(),
                                  v.astype(np.int64) @ b[0].astype(np.int64))
    # a vector times a batch drops the vector's row, as numpy's matmul does
    out = qd.int_matmul(qd.tensor(v, device=device), qd.tensor(b, device=device))
    assert out.shape == (2, 4)
    np.testing.assert_array_equal(out.numpy(), v.astype(np.int64) @ b.astype(np.int64))
    # a vector rhs is one column, dropped again; two vectors give their dot product
    for lhs, rhs in ((a, v), (b[0].T, v), (v, v)):
        out = qd.int_matmul(qd.tensor(lhs, device=device), qd.tensor(rhs, device=device))
        want = lhs.astype(np.int64) @ rhs.astype(np.int64)
        assert out.shape == want.shape and out.dtype == "int32"
        np.testing.assert_array_equal(out.numpy(), want)


def test_bad_inputs_raise_before_any_kernel():
    with pytest.raises(qd.ShapeError, match="K=3 columns but b has K=4 rows"):
        qd.int_matmul(np.zeros((2, 3), np.int8), np.zeros((4, 2), np.int8))
    with pytest.raises(TypeError, match="must be int8"):
        qd.int_matmul(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.int8))
    with pytest.raises(TypeError, match="outside int8"):
        qd.int_matmul(np.full((2, 3), 300), np.zeros((3, 2), np.int8))


def test_empty_dims_give_empty_or_zero_results(device):
    for (m, k, n) in [(0, 4, 3), (2, 0, 3), (2, 4, 0)]:
        out = qd.int_matmul(qd.tensor(np.zeros((m, k), np.int8), device=device),
                            qd.tensor(np.zeros((k, n), np.int8), device=device))
        assert out.shape == (m, n)
        np.testing.assert_array_equal(out.numpy(), np.zeros((m, n), np.int32))


def test_a_0d_operand_is_refused_by_saying_what_is_taken():
    """It said "at least 2 dims", though vectors are taken."""
    with pytest.raises(qd.ShapeError, match=r"^int_matmul multiplies matrices, batches of them and vectors; "
                                            r"got shapes \(\) and \(1, 1\)$"):
        qd.int_matmul(np.int8(3), np.ones((1, 1), np.int8))


def test_a_k_mismatch_names_a_and_b():
    with pytest.raises(qd.ShapeError, match=r"a has K=5 columns but b has K=4 rows"):
        qd.int_matmul(np.ones((2, 5), np.int8), np.ones((4, 3), np.int8))



@pytest.mark.parametrize("dtype", [np.int32, np.int16, np.uint8, np.int64])
def test_integer_arrays_of_any_dtype_multiply_as_int8(device, rng, dtype):
    """int32 arrays were refused ("must be int8 data"), though int64 ones were taken:
    numpy's default integers are int32 on some platforms."""
    lo = 0 if np.dtype(dtype).kind == "u" else -128
    a = rng.integers(lo, 128, size=(3, 33)).astype(dtype)
    b = rng.integers(lo, 128, size=(33, 5)).astype(dtype)
    want = python_int_matmul(a, b)
    np.testing.assert_array_equal(qd.int_matmul(a, b).numpy(), want)
    for lhs, rhs in ((a, qd.tensor(b.astype(np.int8), device=device)),
                     (qd.tensor(a.astype(np.int8), device=device), b)):
        out = qd.int_matmul(lhs, rhs)  # the array joins the tensor's device
        assert out.dtype == "int32" and out.device == device
        np.testing.assert_array_equal(out.numpy(), want)


def test_integers_that_do_not_fit_int8_are_refused_by_position():
    with pytest.raises(qd.ArgumentTypeError, match=r"int8 tensor of int32 data: the value 300 at position \(0, 1\) "
                                                   r"is outside int8's range"):
        qd.int_matmul(np.array([[1, 300]], np.int32), np.ones((2, 1), np.int8))


def test_a_torch_int32_tensor_multiplies_as_int8(rng):
    torch = pytest.importorskip("torch")
    a = rng.integers(-128, 128, size=(2, 9)).astype(np.int32)
    b = rng.integers(-128, 128, size=(9, 4)).astype(np.int8)
    np.testing.assert_array_equal(qd.int_matmul(torch.from_numpy(a), b).numpy(), python_int_matmul(a, b))


@pytest.mark.parametrize("host", ["reference", "cpu"])
def test_a_broadcast_batch_is_written_into_its_result_item_by_item(host, rng):
    """Every item's product was kept in a list, then stacked: twice the result's memory
    at the peak, and a result too large for memory was found out only item by item."""
    if host not in qd.available_backends():
        pytest.skip(f"needs the {host} backend")
    from helpers import transient_bytes
    a = qd.tensor(rng.integers(-128, 128, size=(64, 1, 8, 16), dtype=np.int8), device=host)
    b = qd.tensor(rng.integers(-128, 128, size=(1, 64, 16, 8), dtype=np.int8), device=host)
    kept = []
    extra = transient_bytes(lambda: kept.append(qd.int_matmul(a, b)))
    np.testing.assert_array_equal(kept[0].numpy(), a.numpy().astype(np.int64) @ b.numpy().astype(np.int64))
    assert extra < kept[0].numpy().nbytes / 4, f"{extra} bytes beside a result of {kept[0].numpy().nbytes}"
