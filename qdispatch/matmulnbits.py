"""ONNX Runtime's MatMulNBits weights (the com.microsoft contrib op behind its int4
LLMs): a QTensor out to that op's inputs and attributes, and back, value for value.

MatMulNBits computes Y = A @ dequantize(B).T for a weight of N rows (outputs) by K
columns (inputs), nn.Linear's layout.  Each row is cut into blocks of `block_size`
values along K (a power of two, 16 or more; the last block padded), each block one
scale.  Values are unsigned codes of `bits` bits, packed lowest bits first, meaning
`code - zero_point`; with no zero_points input the zero point is 2^(bits - 1).  That
default makes the op symmetric, as qdispatch's schemes are: a q4f value v is the code
v + 8, a q8f value v + 128, a q2f value v + 2, and nothing is rounded either way."""
import warnings
from typing import NamedTuple

import numpy as np

from . import packing
from ._core import QTensor
from .errors import (ArgumentError, ArgumentTypeError, QDispatchError, QuantSchemeError, SerializationError,
                     ShapeError)
from .scheme import QuantScheme, _whole_number
from .tensor_api import qtensor_from_parts, qtensor_host, tensor

BITS = (2, 4, 8)
SCALE_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}


class MatMulNBitsWeight(NamedTuple):
    """A weight as MatMulNBits takes it: the inputs B and scales, and the op's attributes."""
    B: np.ndarray       # uint8 [N, k_blocks, block_size * bits // 8]: codes packed lowest bits first
    scales: np.ndarray  # [N * k_blocks], float32 or float16 (the model's float type: A's)
    K: int
    N: int
    bits: int
    block_size: int

    @property
    def attributes(self):
        """The op's attributes, for onnx.helper.make_node(..., **w.attributes)."""
        return {"K": self.K, "N": self.N, "bits": self.bits, "block_size": self.block_size}


def export(w, block_size=None, dtype="float32"):
    """QTensor w, of shape [N, K] (nn.Linear's weight), as MatMulNBits inputs.

    Its values must be 2-, 4- or 8-bit and its scales constant over each block of
    `block_size` along K: blocks along K whose size is a multiple of it, or one scale
    per row or for the whole tensor (any grouping of rows), or smaller blocks whose
    scales agree over each (as `load` gives where block_size does not divide K: pass
    the file's block_size to get its layout back).  `block_size=None` takes, of the
    powers of two from 16 to 256 that fit, the largest that divides K, else the
    largest up to K (the least padding).
    `dtype` is the scales' type, which MatMulNBits wants equal to A's: "float32", or
    "float16" where every scale is a float16 value."""
    if not isinstance(w, QTensor):
        raise ArgumentTypeError(f"matmulnbits.export takes a QTensor, got {type(w).__name__}: "
                                f"quantize the weight first (qd.quantize(w, QuantScheme('q4f', block=32, "
                                f"store='packed_u32')))")
    if len(w.shape) != 2:
        raise ShapeError(f"MatMulNBits weights are 2-D, [N, K] (nn.Linear's layout), got shape {w.shape}: "
                         f"reshape or take one matrix of the batch first")
    scheme = w.scheme
    if scheme.bits not in BITS:  # every value has 2, 4 or 8 bits today: kept for a scheme to come
        raise QuantSchemeError(f"MatMulNBits stores 2-, 4- or 8-bit codes, and {scheme!r} has {scheme.bits}")
    N, K = w.shape
    block_n, block_k = w.layout.logical_block(w.transposed)
    values, grid = qtensor_host(w)
    block_size = _block_size_for(block_size, block_k, K, scheme, grid.reshape(N // block_n, K // block_k))
    scale_type = _scale_type(dtype)
    k_blocks = -(-K // block_size)
    # each block's scale: its row's group, and the group along K where the block starts
    scales = np.repeat(grid, block_n, axis=0)[:, (np.arange(k_blocks) * block_size) // block_k]
    if scale_type == np.float16 and not np.array_equal(scales.astype(np.float16).astype(np.float32), scales):
        raise ArgumentError(f"Can't give {scheme!r} scales as float16: some are no float16 values (they would "
                            f"round); use dtype='float32' (and float32 activations), or quantize with "
                            f"scale_dtype='f16'")
    padded = np.zeros((N, k_blocks * block_size), dtype=np.int8)  # padding past K: value 0
    padded[:, :K] = values
    return MatMulNBitsWeight(
        B=_code_bytes(padded, scheme.bits).reshape(N, k_blocks, block_size * scheme.bits // 8),
        scales=np.ascontiguousarray(scales.reshape(-1), dtype=scale_type),
        K=K, N=N, bits=scheme.bits, block_size=block_size)


def load(B, scales, K, N, bits, block_size, zero_points=None, device=None):
    """The QTensor [N, K] that MatMulNBits inputs and attributes hold (in the order of
    MatMulNBitsWeight's fields, so `load(*export(w))` works), on `device`: scheme q2f, q4f
    or q8f by `bits`, in blocks along K of `block_size` (of its largest divisor of K
    where it doesn't divide K: the scales repeat over the blocks of one of its blocks),
    f16 scales for float16 ones and f32 otherwise.  zero_points, where given, must all
    be the default, 2^(bits - 1): qdispatch's schemes have no zero points."""
    K, N, block_size, bits = (_count(v, name) for v, name in
                              ((K, "K"), (N, "N"), (block_size, "block_size"), (bits, "bits")))
    if bits not in BITS:
        raise ArgumentError(f"bits={bits}: MatMulNBits weights qdispatch reads have 2, 4 or 8 bits")
    if block_size < 16 or block_size & (block_size - 1):
        raise ArgumentError(f"block_size={block_size}: MatMulNBits blocks are powers of two, 16 or more")
    k_blocks = -(-K // block_size)
    B = np.asarray(B)
    if B.dtype != np.uint8 or B.size != N * k_blocks * block_size * bits // 8:
        error = ShapeError if B.dtype == np.uint8 else ArgumentTypeError  # a wrong dtype is a TypeError
        raise error(f"B must be uint8 of N * ceil(K / block_size) * block_size * bits / 8 = "
                         f"{N * k_blocks * block_size * bits // 8} bytes for K={K}, N={N}, block_size={block_size}, "
                         f"bits={bits}; got {B.dtype} of shape {B.shape}")
    scales = np.asarray(scales)
    if scales.dtype not in SCALE_DTYPES or scales.size != N * k_blocks:
        error = ShapeError if scales.dtype in SCALE_DTYPES else ArgumentTypeError
        raise error(f"scales must be float32 or float16, one per block: N * ceil(K / block_size) = "
                         f"{N * k_blocks} for K={K}, N={N}, block_size={block_size}; got {scales.dtype} of shape "
                         f"{scales.shape}")
    zero_point = 1 << (bits - 1)
    if zero_points is not None:
        _check_default_zero_points(np.asarray(zero_points), zero_point, bits, N, k_blocks)
    values = _values_of(B.reshape(N, -1), bits, K)
    group = np.gcd(K, block_size)  # qdispatch's blocks divide K: the scales repeat over the smaller ones
    grid = np.repeat(scales.reshape(N, k_blocks).astype(np.float32), block_size // group, axis=1)[:, :K // group]
    scheme = QuantScheme(f"q{bits}f", block=(1, int(group)), store="native" if bits == 8 else "packed_u32",
                         scale_dtype=SCALE_DTYPES[scales.dtype])
    return qtensor_from_parts(values, grid, scheme, device=device)


def load_model(path, device=None):
    """{node name: QTensor} for every MatMulNBits node of the ONNX model at `path`
    (those in subgraphs, an If's branches say, included) whose weight inputs are
    initializers (external data files beside it are read too), each as `load`
    makes it; a node that adds a bias input gives it too, as a float Tensor under
    "<node name>.bias".  Needs the onnx package (pip install 'qdispatch[onnx]')."""
    onnx = _onnx()
    try:
        model = onnx.load(str(path))
    except OSError:  # the file system's own errors, as they are
        raise
    except Exception as exc:  # protobuf's DecodeError and the like: no ONNX model
        raise SerializationError(f"{path} is no ONNX model onnx can read: {exc}") from None
    if not model.HasField("graph"):  # an empty file parses as a model without one
        raise SerializationError(f"{path} holds no ONNX graph: is it an ONNX model?")
    loaded = {}
    for node, initializers in _nodes_with_initializers(model.graph, {}):
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
            continue
        name = node.name or node.output[0]
        try:
            parts = _node_parts(name, node, initializers, device)
        except SerializationError:
            raise
        except (QDispatchError, ValueError, TypeError, KeyError) as exc:  # a node or initializer that lies
            raise SerializationError(f"Can't load MatMulNBits node {name!r} from {path}: {exc}") from exc
        for key, value in parts.items():
            if key in loaded:
                raise SerializationError(f"{path} has two MatMulNBits weights named {key!r}: name its nodes apart")
            loaded[key] = value
    if not loaded:  # a float model, say: an empty dict would pass for a model of no layers
        warnings.warn(f"{path} holds no MatMulNBits node (com.microsoft) to load: its float MatMul weights are "
                      f"plain initializers, which onnx.numpy_helper.to_array reads and qdispatch.quantize "
                      f"quantizes", UserWarning, stacklevel=2)
    return loaded


def _nodes_with_initializers(graph, outer):
    """(node, the initializers it sees) for every node of `graph` and of the
    subgraphs its nodes hold, in order; a subgraph sees its outer graphs' too."""
    from onnx import AttributeProto
    initializers = dict(outer, **{t.name: t for t in graph.initializer})
    for node in graph.node:
        yield node, initializers
        for attribute in node.attribute:
            inner = ([attribute.g] if attribute.type == AttributeProto.GRAPH else
                     attribute.graphs if attribute.type == AttributeProto.GRAPHS else [])
            for subgraph in inner:
                yield from _nodes_with_initializers(subgraph, initializers)


def _node_parts(name, node, initializers, device):
    """{name: its weight's QTensor} for one MatMulNBits node, and its bias, if any."""
    from onnx import helper, numpy_helper
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    absent = [key for key in ("K", "N", "block_size") if key not in attributes]
    if absent:
        raise SerializationError(f"MatMulNBits node {name!r} lacks the attribute(s) {', '.join(absent)}, which "
                                 f"the op requires")
    inputs = list(node.input) + [""] * 6  # A, B, scales, zero_points, g_idx, bias
    if inputs[4]:  # g_idx: a permutation of K's rows, no block layout
        raise SerializationError(f"MatMulNBits node {name!r} has a g_idx input (act-order weights), "
                                 f"which qdispatch's block schemes can't hold")
    if not inputs[1] or not inputs[2]:
        raise SerializationError(f"MatMulNBits node {name!r} has no B or no scales input, which the op requires")
    missing = [i for i in inputs[1:4] + [inputs[5]] if i and i not in initializers]
    if missing:
        raise SerializationError(f"MatMulNBits node {name!r} reads {', '.join(missing)} from the graph, not "
                                 f"from initializers: only constant weights load")

    def array(i):
        return numpy_helper.to_array(initializers[inputs[i]])
    parts = {name: load(array(1), array(2), attributes["K"], attributes["N"], attributes.get("bits", 4),
                        attributes["block_size"], array(3) if inputs[3] else None, device)}
    if inputs[5]:
        bias = array(5)
        if bias.shape != (attributes["N"],) or bias.dtype not in SCALE_DTYPES:
            raise SerializationError(f"MatMulNBits node {name!r} has a bias of {bias.dtype} {bias.shape}, "
                                     f"expected float32 or float16 ({attributes['N']},)")
        parts[name + ".bias"] = tensor(bias, device=device)
    return parts


def _onnx():
    try:
        import onnx
    except ImportError:
        raise ImportError("Reading ONNX models needs the onnx package: pip install 'qdispatch[onnx]'") from None
    return onnx


def _block_size_for(asked, block_k, K, scheme, grid):
    """MatMulNBits' block size for groups of block_k along K with scales `grid` [row
    groups, K / block_k]: a power of two from 16 whose blocks each see one scale."""
    fits = [b for b in (256, 128, 64, 32, 16) if _one_scale_a_block(b, block_k, K, grid)]
    if asked is None:
        if not fits:
            raise QuantSchemeError(f"{scheme!r} has scale groups of {block_k} along K, and MatMulNBits' blocks "
                                   f"(powers of two, 16 or more) each need one scale: requantize in blocks of "
                                   f"16, 32, 64 or 128 along K" + (" (a weight laid out [K, N], for x @ w, exports "
                                                                  "as w.T)" if block_k == 1 else ""))
        # the largest block that cuts K evenly, else the largest within K (the least padding)
        return next((b for b in fits if K % b == 0), next((b for b in fits if b <= K), fits[-1]))
    size = _count(asked, "block_size")
    if size < 16 or size & (size - 1) or size not in fits:
        raise ArgumentError(f"block_size={asked} doesn't fit {scheme!r} on K={K}: MatMulNBits' blocks are powers "
                            f"of two, 16 or more, each with one scale (inside one scale group, {block_k} along K, "
                            f"or over groups whose scales agree)" + (f"; {fits[0]} fits" if fits else ""))
    return size


def _one_scale_a_block(size, block_k, K, grid):
    """Whether every block of `size` along K sees one scale: it lies inside one group
    of block_k (or one group spans K), or spans whole groups whose scales agree (the
    last block, short where size does not divide K, over the groups it has)."""
    if block_k == K or block_k % size == 0:
        return True
    if size % block_k:
        return False
    per_block = size // block_k
    tail = -grid.shape[1] % per_block  # the last block's missing groups: copies of its last
    spans = np.concatenate([grid, np.repeat(grid[:, -1:], tail, axis=1)], axis=1).reshape(grid.shape[0], -1, per_block)
    return bool((spans == spans[:, :, :1]).all())


def _scale_type(dtype):
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in ("float32", "float16"):
        raise ArgumentTypeError(f"dtype={dtype!r}: MatMulNBits scales here are float32 or float16 (A's type)")
    return np.dtype(name).type


def _count(value, name):
    n = _whole_number(value)
    if n is None or n < 1:
        raise ArgumentTypeError(f"{name} must be a positive int, got {value!r}")
    return n


def _check_default_zero_points(zero_points, zero_point, bits, N, k_blocks):
    """Zero points come packed like B, each row in whole bytes (uint8), or one per
    block in A's type."""
    if zero_points.dtype == np.uint8:
        row_bytes = -(-k_blocks * bits // 8)
        if zero_points.size != N * row_bytes:
            raise ShapeError(f"uint8 zero_points hold {row_bytes} bytes a row for {k_blocks} blocks of {bits} bits, "
                             f"{N * row_bytes} in all; got shape {zero_points.shape}")
        values = _values_of(zero_points.reshape(N, row_bytes), bits, k_blocks)
        zero_points = values.astype(np.int16) + zero_point  # the codes
    elif zero_points.size != N * k_blocks:
        raise ShapeError(f"zero_points in A's type hold one per block, {N * k_blocks}; got shape {zero_points.shape}")
    if not (zero_points == zero_point).all():
        raise ArgumentError(f"These MatMulNBits weights have zero points other than {zero_point} (asymmetric "
                            f"codes), and qdispatch's schemes are symmetric: dequantize them as (code - zero_point) "
                            f"* scale and quantize the float weight with qd.quantize")


# A code is its value plus the zero point 2^(bits - 1): in `bits` bits, the value's two's
# complement field with its top bit flipped.  So code bytes are the packed_u32 store's
# words, little-endian, with that bit flipped in every field, and the store's codec serves.
_TOP_BITS = {2: 0xAAAAAAAA, 4: 0x88888888, 8: 0x80808080}


def _code_bytes(values, bits):
    """int8 values [rows, n] (n a whole number of words) -> their code bytes, lowest bits first."""
    words = packing.pack_u32(values, bits) ^ np.uint32(_TOP_BITS[bits])
    return words.astype("<u4").view(np.uint8).reshape(values.shape[0], -1)


def _values_of(code_bytes, bits, n):
    """_code_bytes' inverse for rows of any length: the first n values of each row."""
    rows, width = code_bytes.shape
    whole = np.zeros((rows, -(-width // 4) * 4), dtype=np.uint8)  # rows padded to whole words
    whole[:, :width] = code_bytes
    words = whole.view("<u4").astype(np.uint32) ^ np.uint32(_TOP_BITS[bits])
    return packing.unpack_u32(words, bits, words.shape[1] * (32 // bits))[:, :n]
