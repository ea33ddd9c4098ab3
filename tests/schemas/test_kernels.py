"""The compiled codec loops (schemas/_kernels.c) against the numpy versions they replace:
the same payload decodes to the same floats, bit for bit, and the same input encodes to the
same bytes (sign's scales, summed in another order, to within float rounding)."""

from __future__ import annotations

import contextlib
import itertools
import os
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from schemas.codecs import BUCKET, CodecError, bits, make_codec

pytestmark = pytest.mark.skipif(not bits.compiled(), reason="schemas._kernels was not built (no C compiler)")

DECODED = ["fp16", "int8", "sign", "ternary", "qsgd:1", "qsgd:4", "qsgd:16", "qsgd:127"]
values = hnp.arrays(
    np.float32,
    st.integers(0, 3 * BUCKET + 13),
    elements=st.floats(-1e4, 1e4, width=32) | st.sampled_from([0.0, -0.0, 1e-40, -3e-39, 6e-8]),
)


@pytest.fixture(autouse=True, params=["simd", "plain"])
def loops(request):
    """Every test twice: with the AVX-512 loops where this CPU has them, and with the plain C loops."""
    if bits.kernels is not None:
        bits.kernels.use_avx512(request.param == "simd")
    yield
    if bits.kernels is not None:  # as imported
        bits.kernels.use_avx512(os.environ.get("EDGEPS_NO_AVX512") is None)


@contextlib.contextmanager
def numpy_only():
    kernels, bits.kernels = bits.kernels, None
    try:
        yield
    finally:
        bits.kernels = kernels


def both(call):
    """(compiled result, numpy result), each a value or the CodecError raised."""
    results = []
    for context in (contextlib.nullcontext(), numpy_only()):
        with context:
            try:
                results.append(call())
            except CodecError as exc:
                results.append(exc)
    return results


def same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype == np.float32
        and a.view(np.uint32).tobytes() == b.view(np.uint32).tobytes()
    )


@pytest.mark.parametrize("spec", DECODED)
@settings(max_examples=60, deadline=None)
@given(x=values, seed=st.integers(0, 2**32 - 1))
def test_decoders_give_the_same_bits(spec, x, seed) -> None:
    codec = make_codec(spec)
    with numpy_only():
        payload = codec.encode(x, np.random.default_rng(seed))
    compiled, plain = both(lambda: codec.decode(payload, x.shape))
    assert same_floats(compiled, plain)


def test_fp16_decodes_every_half_like_numpy() -> None:
    halves = np.arange(65536, dtype=np.uint16).tobytes()
    compiled, plain = both(lambda: make_codec("fp16").decode(halves, (65536,)))
    nan = np.isnan(plain)
    assert (np.isnan(compiled) == nan).all()
    assert same_floats(compiled[~nan], plain[~nan])


@settings(max_examples=100, deadline=None)
@given(x=values)
def test_int8_encodes_the_same_bytes(x) -> None:
    compiled, plain = both(lambda: make_codec("int8").encode(x))
    assert compiled == plain


@settings(max_examples=100, deadline=None)
@given(x=values)
def test_sign_encodes_the_same_bits_and_scales(x) -> None:
    compiled, plain = both(lambda: make_codec("sign").encode(x))
    nb = -(-len(x) // BUCKET)
    assert compiled[4 * nb :] == plain[4 * nb :]
    np.testing.assert_allclose(np.frombuffer(compiled, "<f4", nb), np.frombuffer(plain, "<f4", nb), rtol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_int8_refuses_non_finite_values_either_way(bad) -> None:
    x = np.ones(2 * BUCKET + 3, np.float32)
    x[BUCKET + 1] = bad
    compiled, plain = both(lambda: make_codec("int8").encode(x))
    assert isinstance(compiled, CodecError) and isinstance(plain, CodecError)


@pytest.mark.parametrize("spec", ["ternary", "qsgd:1", "qsgd:4", "qsgd:16"])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_invalid_codes_are_refused_either_way(spec, data) -> None:
    """Payloads of the right length with arbitrary bits: both refuse, or both give the same floats."""
    n = data.draw(st.integers(1, 2 * BUCKET + 9))
    size = len(make_codec(spec).encode(np.zeros(n, np.float32), np.random.default_rng(0)))
    scales = np.frombuffer(data.draw(st.binary(min_size=4, max_size=4)) * -(-n // BUCKET), np.uint8)
    body = data.draw(st.binary(min_size=size - len(scales), max_size=size - len(scales)))
    payload = scales.tobytes() + body
    compiled, plain = both(lambda: make_codec(spec).decode(payload, (n,)))
    if isinstance(plain, CodecError):
        assert isinstance(compiled, CodecError)
    else:
        nan = np.isnan(plain)
        assert (np.isnan(compiled) == nan).all() and same_floats(compiled[~nan], plain[~nan])


def test_kernels_refuse_short_buffers() -> None:
    from schemas import _kernels

    with pytest.raises(ValueError, match="need"):
        _kernels.int8_decode(b"\0" * 4, b"\0" * 600, bytearray(16), BUCKET)
    with pytest.raises(ValueError, match="multiple of 8"):
        _kernels.sign_decode(b"\0" * 4, b"\0", bytearray(32), 5)


def test_fp16_encodes_every_float32_as_numpys_clipped_cast_does() -> None:
    """Every kind of float32 (random bit patterns: normals, subnormals, ties, beyond 65504, inf, NaN
    payloads) gives the bytes of numpy's cast of the clipped value."""
    rng = np.random.default_rng(7)
    patterns = rng.integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array(
        [65504, 65505, 65519.99, 65520, 2.0**-24, 2.0**-25, 2.0**-14, 6.0975e-5, 1e-45, np.inf], np.float32
    )
    x = np.concatenate([patterns, edges, -edges, rng.normal(0, 1e-6, 10_000).astype(np.float32)])
    fp16 = make_codec("fp16")
    compiled = fp16.encode(x)
    with numpy_only():
        assert compiled == fp16.encode(x)
    assert compiled == np.clip(x, -65504, 65504).astype("<f2").tobytes()


@settings(max_examples=50, deadline=None)
@given(values)
def test_fp16_round_trips_like_numpy(x: np.ndarray) -> None:
    fp16 = make_codec("fp16")
    with numpy_only():
        expected = fp16.decode(fp16.encode(x), x.shape)
    np.testing.assert_array_equal(fp16.decode(fp16.encode(x), x.shape), expected)


STOCHASTIC = ["ternary", "qsgd:1", "qsgd:4", "qsgd:16", "qsgd:127"]


@pytest.mark.parametrize("spec", STOCHASTIC)
@settings(max_examples=60, deadline=None)
@given(x=values, seed=st.integers(0, 2**32 - 1))
def test_stochastic_encoders_give_the_same_bytes(spec, x, seed) -> None:
    """Both draw from the same counter-based stream (bits.uniforms), so the payloads are equal."""
    compiled, plain = both(lambda: make_codec(spec).encode(x, np.random.default_rng(seed)))
    assert compiled == plain


@pytest.mark.parametrize("fraction", ["topk:0.01", "topk:0.3", "topk:1"])
@settings(max_examples=60, deadline=None)
@given(x=values | hnp.arrays(np.float32, st.integers(1, 300), elements=st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.0])))
def test_topk_encodes_the_same_bytes(fraction, x) -> None:
    """The radix select and numpy's partition keep the same values: the k largest |x|, ties to the lowest index."""
    compiled, plain = both(lambda: make_codec(fraction).encode(x))
    assert compiled == plain
    codec = make_codec(fraction)
    k = codec.keep(len(x))
    kept = np.flatnonzero(codec.decode(compiled, x.shape)) if k else []
    order = np.lexsort((np.arange(len(x)), -np.abs(x)))  # by |x| descending, then index
    assert set(kept) <= set(order[:k].tolist())  # (a kept value may quantize to 0)


def test_topk_select_survives_a_sample_that_misleads_it() -> None:
    """A tensor large enough to be sampled, whose large values all lie between the sampled blocks: the threshold
    from the sample lets too few through, and the pass over every value still finds the k largest."""
    n = 1 << 16
    x = np.zeros(n, np.float32)
    x[np.arange(n) % 128 >= 16] = np.linspace(1, 2, n - n // 8, dtype=np.float32)  # the sample sees zeros only
    codec = make_codec("topk:0.1")
    compiled, plain = both(lambda: codec.encode(x))
    assert compiled == plain
    kept = np.flatnonzero(codec.decode(compiled, x.shape))
    assert len(kept) == codec.keep(n) and np.abs(x[kept]).min() >= np.sort(np.abs(x))[-codec.keep(n)]


@pytest.mark.parametrize("spec", ["ternary", "qsgd:16", "qsgd:1", "topk:0.1"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_encoders_refuse_non_finite_values_either_way(spec, bad) -> None:
    x = np.ones(2 * BUCKET + 3, np.float32)
    x[BUCKET + 1] = bad
    compiled, plain = both(lambda: make_codec(spec).encode(x, np.random.default_rng(0)))
    assert isinstance(compiled, CodecError) and isinstance(plain, CodecError)


def test_the_random_stream_is_uniform_and_keyed() -> None:
    u = bits.uniforms((12345, 678), 1 << 20)
    assert u.dtype == np.float32 and u.min() >= 0 and u.max() < 1
    counts = np.histogram(u, bins=64, range=(0, 1))[0]
    expected = len(u) / 64
    assert ((counts - expected) ** 2 / expected).sum() < 120  # chi-square, 63 degrees of freedom: p < 1e-6
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01  # neighbours are not correlated
    assert abs(np.corrcoef(u, bits.uniforms((12346, 678), 1 << 20))[0, 1]) < 0.01  # nor streams of next keys


@settings(max_examples=100, deadline=None)
@given(
    x=hnp.arrays(
        np.float32,
        st.integers(1, 2 * BUCKET + 45),
        elements=st.sampled_from([2.0**27, 1.0, 3.0, 1.5, 0.1, 7e3]) | st.floats(-1e4, 1e4, width=32),
    )
)
def test_numpy_l2_norms_sum_in_the_compiled_order(x: np.ndarray) -> None:
    """The squares are added in the compiled loop's order (32 partial sums, then those in order, then the tail),
    so double rounding is the same on both paths; values of very unequal size make the order matter."""

    def reference(row: np.ndarray) -> float:
        whole = len(row) // 32 * 32
        partial = [0.0] * 32
        for i in range(0, whole, 32):
            for k in range(32):
                partial[k] += float(row[i + k]) ** 2
        total = 0.0
        for p in partial:
            total += p
        for v in row[whole:]:
            total += float(v) ** 2
        return total

    rows = [x[lo : lo + BUCKET] for lo in range(0, len(x), BUCKET)]
    for row in rows:
        assert bits.sum_squares(row[None, :])[0] == reference(row)
    expected = np.sqrt([reference(row) for row in rows]).astype(np.float32)
    np.testing.assert_array_equal(bits.bucket_reduce(x, "l2"), expected)
    payload = bits.kernels.qsgd_encode(x, 0, 0, 16, 8, BUCKET)
    np.testing.assert_array_equal(np.frombuffer(payload, "<f4", len(rows)), expected)


@settings(max_examples=400, deadline=None)
@given(data=st.binary(min_size=0, max_size=700), start=st.integers(0, 15), value=st.sampled_from([0, 1, 0xFFFFFFFF]))
def test_crc32_is_zlibs_at_every_length_and_alignment(data, start, value) -> None:
    """Frames are checked with the compiled CRC-32 where the CPU multiplies carry-less (64 bytes on
    folded, the rest by table): every length, offset (an unaligned view) and starting value gives
    zlib's."""
    assert bits.kernels is not None
    view = memoryview(data)[start:]
    assert bits.kernels.crc32(view, value) == zlib.crc32(view, value)


def test_crc32_is_zlibs_on_a_commit_with_any_one_bit_flipped() -> None:
    from edgeps.bench.load import commit_template

    assert bits.kernels is not None
    body = bytearray(commit_template("d1"))
    assert bits.kernels.crc32(body) == zlib.crc32(body)
    for position in range(0, len(body) * 8, 997):  # every 997th bit flipped alone
        body[position // 8] ^= 1 << (position % 8)
        assert bits.kernels.crc32(body) == zlib.crc32(body)
        body[position // 8] ^= 1 << (position % 8)


poly1305_found = pytest.mark.skipif(
    bits.kernels is None or not bits.kernels.has_poly1305(), reason="no OpenSSL 3 libcrypto found"
)


@poly1305_found
@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=32, max_size=32), st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=6))
def test_poly1305_is_the_cryptography_packages_over_any_split_of_the_bytes(
    key: bytes, data: bytes, cuts: list[int]
) -> None:
    """The journal's tag through OpenSSL is the cryptography package's Poly1305 of the parts joined,
    however the bytes are split (blocks straddle parts; empty parts; a short last block)."""
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    bounds = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
    parts = [data[a:b] for a, b in itertools.pairwise(bounds)]
    assert bits.kernels.poly1305(key, parts) == Poly1305.generate_tag(key, data)


@poly1305_found
def test_poly1305_meets_the_rfcs_vector_and_refuses_what_is_not_a_key_and_buffers() -> None:
    key = bytes.fromhex("85d6be7857556d337f4452fe42d506a80103808afb0db2fd4abff6af4149f51b")  # RFC 8439 2.5.2
    tag = bits.kernels.poly1305(key, [b"Cryptographic Forum ", memoryview(b"Research Group"), bytearray()])
    assert tag.hex() == "a8061dc1305136c6c22b8baf0c0127a9"
    with pytest.raises(ValueError, match="32 bytes"):
        bits.kernels.poly1305(b"short", [b""])
    with pytest.raises(TypeError):
        bits.kernels.poly1305(key, [b"ok", "text"])
    with pytest.raises(TypeError, match="sequence"):
        bits.kernels.poly1305(key, 5)
