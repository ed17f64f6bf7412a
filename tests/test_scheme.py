import itertools
import json
import time

import numpy as np
import pytest

from qdispatch import QuantScheme, QuantSchemeError
from qdispatch.scheme import SCALE_DTYPES, STORES, VALUE_RANGES

GRANULARITIES = [dict(), dict(axis=0), dict(axis=-1), dict(block=32), dict(block=(1, 32)), dict(block=(4, 8))]


@pytest.mark.parametrize("value,store,scale_dtype,gran", list(itertools.product(
    VALUE_RANGES, STORES, SCALE_DTYPES, range(len(GRANULARITIES)))))
def test_every_combination_is_valid_or_says_why(value, store, scale_dtype, gran):
    kwargs = dict(value=value, store=store, scale_dtype=scale_dtype, **GRANULARITIES[gran])
    sub_byte = VALUE_RANGES[value][2] < 8
    if sub_byte and store == "native":
        with pytest.raises(QuantSchemeError, match=f"Can't store native sub-byte values: {value} needs store='packed_u32'"):
            QuantScheme(**kwargs)
    else:
        s = QuantScheme(**kwargs)
        assert s.bits == VALUE_RANGES[value][2]
        assert s.qrange == VALUE_RANGES[value][:2]


@pytest.mark.parametrize("kwargs,message", [
    (dict(value="q3s"), "Unknown value 'q3s': valid values are q8s, q8f, q4s, q4f, q2s, q2f"),
    (dict(store="packed_u8"), "Unknown store 'packed_u8'"),
    (dict(scale_dtype="f64"), "Unknown scale_dtype 'f64'"),
    (dict(block=0), "block sizes must be positive"),
    (dict(block=(1, -32)), "block sizes must be positive"),
    (dict(block=()), "block sizes must be positive"),
    (dict(block="32"), "block must be None, an int or a tuple"),
    (dict(block=True), "block must be None"),
    (dict(block=(1, np.True_)), "block sizes must be positive"),
    (dict(block=32.0), "block must be None, an int or a tuple"),
    (dict(axis=True), "axis must be an int"),
    (dict(axis=np.True_), "axis must be an int"),  # numpy before 2.3 gives its bool an index
    (dict(axis=0, block=32), "Choose one granularity"),
    (dict(axis=1.5), "axis must be an int"),
])
def test_invalid_fields_are_named(kwargs, message):
    with pytest.raises(QuantSchemeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        QuantScheme(**kwargs)


def test_scheme_error_is_a_value_error():
    with pytest.raises(ValueError):
        QuantScheme("q4s")


def test_block_shape_is_full_rank_per_granularity():
    assert QuantScheme("q8s").block_shape((4, 64)) == (4, 64)
    assert QuantScheme("q8s", axis=0).block_shape((4, 64)) == (1, 64)
    assert QuantScheme("q8s", axis=-1).block_shape((4, 64)) == (4, 1)
    assert QuantScheme("q8s", block=32).block_shape((4, 64)) == (1, 32)
    assert QuantScheme("q8s", block=(2, 32)).block_shape((3, 4, 64)) == (1, 2, 32)


def test_block_that_does_not_divide_is_an_error():
    with pytest.raises(QuantSchemeError, match="block size 32 does not divide dim 1 of size 48"):
        QuantScheme("q8s", block=32).block_shape((4, 48))
    with pytest.raises(QuantSchemeError, match="axis=2 is out of range"):
        QuantScheme("q8s", axis=2).block_shape((4, 48))
    with pytest.raises(QuantSchemeError, match="has 3 dims"):
        QuantScheme("q8s", block=(1, 1, 4)).block_shape((4, 48))


def test_int_block_and_tuple_normalise():
    assert QuantScheme("q8s", block=32).block == (32,)
    assert QuantScheme("q8s", block=[1, 32]).block == (1, 32)
    assert QuantScheme("q8s", block=32) == QuantScheme("q8s", block=(32,))


def test_numpy_integers_are_sizes_and_axes():
    """Sizes read off an array's shape or an np.int64 count as ints, and become
    Python ints: the scheme compares, hashes and saves as one written with ints."""
    blocked = QuantScheme("q8s", block=(np.int64(1), np.int32(32)))
    assert blocked == QuantScheme("q8s", block=(1, 32)) and hash(blocked) == hash(QuantScheme("q8s", block=(1, 32)))
    assert all(type(b) is int for b in blocked.block)
    assert QuantScheme("q8s", block=np.int64(32)).block == (32,)
    per_row = QuantScheme("q8s", axis=np.int64(0))
    assert per_row.axis == 0 and type(per_row.axis) is int
    assert QuantScheme.from_record(json.loads(json.dumps(per_row.to_record()))) == per_row
    assert QuantScheme("q8s", block=32).to_record() == {  # plain JSON types, as a file holds them
        "value": "q8s", "block": [32], "axis": None, "store": "native", "scale_dtype": "f32"}



def test_numpy_strings_are_names():
    """Names read out of a numpy array (np.str_) are taken and kept as plain str,
    as every backend's compiled code takes them."""
    names = np.array(["q4s", "packed_u32", "bf16"])
    scheme = QuantScheme(names[0], block=32, store=names[1], scale_dtype=names[2])
    assert scheme == QuantScheme("q4s", block=32, store="packed_u32", scale_dtype="bf16")
    assert all(type(f) is str for f in (scheme.value, scheme.store, scheme.scale_dtype))
    assert repr(scheme) == "QuantScheme('q4s', block=(32,), store='packed_u32', scale_dtype='bf16')"


@pytest.mark.parametrize("kwargs,message", [
    (dict(value=["q8s"]), "Unknown value ['q8s']: valid values are q8s, q8f"),
    (dict(value=b"q8s"), "Unknown value b'q8s'"),
    (dict(store=None), "Unknown store None: valid stores are native, packed_u32"),
    (dict(scale_dtype=16), "Unknown scale_dtype 16: valid scale_dtypes are f32, f16, bf16"),
])
def test_names_that_are_no_strings_are_named(kwargs, message):
    with pytest.raises(QuantSchemeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        QuantScheme(**kwargs)

@pytest.mark.parametrize("block,dim,hint", [
    (32, 48, 24),                 # the nearest divisor
    (32, 24, 24),                 # a block past the dim: the dim itself
    (32, 2**31 - 2, 33),          # 31 and 33 divide it: a tie goes to the larger
    (32, 2**31 - 1, 1),           # a prime: only 1 divides it
    (2**20, 2**31 - 2, 1049601),  # a large block on a large dim
])
def test_block_hint_is_the_nearest_divisor_and_quick_for_any_dim(block, dim, hint):
    """The hint walks out from the block, never over every integer up to the dim:
    a dim of 2**31 - 1 (say, read from a damaged file) answers at once."""
    start = time.perf_counter()
    with pytest.raises(QuantSchemeError, match=rf"does not divide dim 1 of size {dim} .*e\.g\. {hint}$"):
        QuantScheme("q8s", block=block).block_shape((4, dim))
    assert time.perf_counter() - start < 1  # a walk over every integer up to 2**31 takes minutes
    assert dim % hint == 0
