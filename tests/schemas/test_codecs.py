from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from schemas.codecs import BUCKET, CodecError, ErrorFeedback, make_codec, pack_bits, unpack_bits
from schemas.frame import Frame, FrameError, FrameKind, decode_frame, encode_frame

SPECS = ["fp32", "fp16", "int8", "sign", "ternary", "qsgd:1", "qsgd:4", "qsgd:16", "topk:0.1", "topk:1"]
finite = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=1, max_dims=3, max_side=40),
    elements=st.floats(-1e3, 1e3, width=32),
)


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=40)
@given(values=finite)
def test_round_trip_shape_dtype_and_error_bound(spec, values) -> None:
    codec = make_codec(spec)
    rng = np.random.default_rng(0)
    decoded = codec.decode(codec.encode(values, rng), values.shape)
    assert decoded.shape == values.shape and decoded.dtype == np.float32
    flat, out = values.reshape(-1).astype(np.float64), decoded.reshape(-1).astype(np.float64)
    bound = np.repeat(
        [np.abs(flat[i : i + BUCKET]).max() if len(flat[i : i + BUCKET]) else 0 for i in range(0, len(flat), BUCKET)],
        BUCKET,
    )[: len(flat)]
    if spec == "fp32":
        np.testing.assert_array_equal(decoded, values)
    elif spec == "fp16":
        np.testing.assert_allclose(out, flat, rtol=1e-3, atol=1e-4)
    elif spec == "int8":
        assert np.all(np.abs(out - flat) <= bound / 127 / 2 * 1.0001 + 1e-12)
    elif spec in ("sign", "ternary"):  # every value becomes 0 or +-scale, scale <= bucket max
        assert np.all(np.abs(out) <= bound * 1.0001 + 1e-12)
        assert np.all((out == 0) | (np.sign(out) == np.sign(flat)) | (flat == 0))
    elif spec.startswith("qsgd"):  # magnitude at most the bucket's L2 norm, sign kept
        assert np.all((out == 0) | (np.sign(out) == np.sign(flat)))
    elif spec == "topk:1":
        assert np.all(np.abs(out - flat) <= np.abs(flat).max() / 127 / 2 * 1.0001 + 1e-12)


@pytest.mark.parametrize("spec", ["ternary", "qsgd:4", "qsgd:16"])
def test_stochastic_codecs_are_unbiased(spec) -> None:
    codec = make_codec(spec)
    values = np.random.default_rng(1).normal(size=1000).astype(np.float32)
    rng = np.random.default_rng(2)
    mean = np.mean([codec.decode(codec.encode(values, rng), values.shape) for _ in range(3000)], axis=0)
    spread = np.abs(values).max() if spec == "ternary" else np.linalg.norm(values[:BUCKET]) / codec.levels
    # The mean of 3000 draws is within 5 standard errors of the truth for every value.
    assert np.max(np.abs(mean - values)) < 5 * spread / np.sqrt(3000) * 1.5


def test_topk_keeps_the_largest_and_sizes_follow_the_fraction() -> None:
    codec = make_codec("topk:0.01")
    values = np.random.default_rng(0).normal(size=100_000).astype(np.float32)
    payload = codec.encode(values)
    decoded = codec.decode(payload, values.shape)
    kept = np.flatnonzero(decoded)
    assert len(kept) == 1000
    assert np.abs(values[kept]).min() >= np.sort(np.abs(values))[-1000]
    assert len(payload) < 4 * len(values) / 50  # more than 50x smaller than fp32


@pytest.mark.parametrize("spec", ["fp16", "int8", "sign", "topk:0.05"])
def test_error_feedback_accounts_for_every_dropped_bit(spec) -> None:
    codec = make_codec(spec)
    feedback = ErrorFeedback(codec)
    rng = np.random.default_rng(3)
    sent_total = np.zeros(2000, np.float64)
    true_total = np.zeros(2000, np.float64)
    for _ in range(50):
        step = {"w": rng.normal(size=2000).astype(np.float32)}
        true_total += step["w"]
        sent, payloads = feedback.encode(step)
        np.testing.assert_allclose(sent["w"], codec.decode(payloads["w"], (2000,)), atol=1e-6)
        sent_total += sent["w"]
    # What was sent plus what is still held back is exactly what there was to send.
    np.testing.assert_allclose(sent_total + feedback.residual["w"], true_total, atol=1e-3)


def test_unbiased_codecs_get_no_feedback() -> None:
    feedback = ErrorFeedback(make_codec("qsgd:8"))
    step = {"w": np.ones(4, np.float32)}
    sent, payloads = feedback.encode(step)
    assert sent is step and feedback.residual == {} and set(payloads) == {"w"}


@given(codes=st.lists(st.integers(0, 255), max_size=100), bits=st.sampled_from([1, 2, 4, 8]))
def test_bit_packing_round_trips(codes, bits) -> None:
    array = (np.array(codes, dtype=np.int64) % (1 << bits)).astype(np.uint8)
    packed = pack_bits(array, bits)
    assert len(packed) == -(-len(array) * bits // 8)
    np.testing.assert_array_equal(unpack_bits(packed, bits, len(array)), array)


@pytest.mark.parametrize("spec", SPECS)
def test_codec_travels_in_the_frame_header(spec) -> None:
    values = {"w": np.linspace(-1, 1, 3000, dtype=np.float32).reshape(30, 100)}
    frame = Frame(
        kind=FrameKind.COMMIT, base_version=1, tensors=values, device="d", seq=1, samples=1, steps=1, codec=spec
    )
    back = decode_frame(encode_frame(frame, np.random.default_rng(0)))
    assert back.codec == make_codec(spec).spec
    assert back.tensors["w"].shape == (30, 100)


@pytest.mark.parametrize("spec", ["nope", "qsgd:0", "qsgd:200", "qsgd:x", "topk:0", "topk:2", "sign:3"])
def test_bad_specs_are_refused(spec) -> None:
    with pytest.raises(CodecError):
        make_codec(spec)


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=200)
@given(data=st.binary(max_size=200))
def test_arbitrary_payloads_never_crash_a_decoder(spec, data) -> None:
    codec = make_codec(spec)
    with contextlib.suppress(CodecError):
        codec.decode(data, (7, 9))


def test_frames_with_arbitrary_codec_payloads_are_refused_cleanly() -> None:
    frame = Frame(kind=FrameKind.COMMIT, base_version=1, tensors={"w": np.ones(10, np.float32)}, codec="topk:0.5")
    raw = bytearray(encode_frame(frame))
    raw[-10] ^= 0xFF  # corrupt the payload but keep the CRC wrong: refused as corrupted
    with pytest.raises(FrameError):
        decode_frame(bytes(raw))


def test_a_new_codec_is_one_registered_class() -> None:
    """The example of docs/CODECS.md: bfloat16 by truncation, known to frames once registered."""
    from schemas.codecs import base as registry
    from schemas.codecs import codec_from_header, known, register
    from schemas.codecs.base import Codec, count, expect, flat
    from schemas.frame import Frame, FrameKind, decode_frame, encode_frame

    @register
    class Bf16(Codec):
        id = 7
        name = "bf16"
        biased = True

        def encode(self, values: np.ndarray, rng: np.random.Generator | None = None) -> bytes:
            return (flat(values).view("<u4") >> 16).astype("<u2").tobytes()

        def decode(self, payload: bytes | memoryview, shape: tuple[int, ...]) -> np.ndarray:
            expect(payload, 2 * count(shape), self.name)
            wide = np.frombuffer(payload, "<u2").astype(np.uint32) << 16
            return wide.view(np.float32).reshape(shape)

    try:
        assert "bf16" in known() and isinstance(codec_from_header(7, 0.0), Bf16)
        values = np.array([[1.0, -2.5], [3.140625, 1e-3]], np.float32)
        frame = decode_frame(encode_frame(Frame(FrameKind.PARAMS, 3, {"w": values}, codec="bf16")))
        assert frame.codec == "bf16"
        np.testing.assert_allclose(frame.tensors["w"], values, rtol=2**-7)
        with pytest.raises(ValueError, match="already registered"):
            register(type("Again", (Bf16,), {"id": 0, "name": "bf16b"}))  # fp32 has wire id 0
    finally:
        del registry._BY_NAME["bf16"], registry._BY_ID[7]
