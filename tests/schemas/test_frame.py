from __future__ import annotations

import contextlib
import dataclasses
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from schemas.frame import Frame, FrameError, FrameKind, decode_frame, encode_frame

# The worked example of docs/PROTOCOL.md, byte for byte.
WORKED_EXAMPLE = Frame(
    kind=FrameKind.COMMIT,
    base_version=3,
    tensors={"w": np.array([[1.0, -2.5]], dtype=np.float32)},
    device="dev-01",
    seq=7,
    samples=32,
    steps=1,
)
WORKED_HEX = (
    "45505346"
    "01"
    "01"
    "00"
    "00"
    "00000000"
    "0300000000000000"
    "0700000000000000"
    "20000000"
    "01000000"
    "06"
    "6465762d3031"
    "0100"
    "01"
    "77"
    "02"
    "01000000"
    "02000000"
    "08000000"
    "0000803f"
    "000020c0"
    "52337312"
)


def test_worked_example_matches_protocol_doc() -> None:
    assert encode_frame(WORKED_EXAMPLE).hex() == WORKED_HEX


def test_round_trip_keeps_every_field_and_value() -> None:
    frame = Frame(
        kind=FrameKind.PARAMS,
        base_version=2**40,
        tensors={"dense0.w": np.arange(12, dtype=np.float32).reshape(3, 4), "dense0.b": np.float32([-0.0, 1e-30])},
        seq=0,
    )
    back = decode_frame(encode_frame(frame))
    assert (back.kind, back.base_version, back.device, back.codec) == (FrameKind.PARAMS, 2**40, "", "fp32")
    assert list(back.tensors) == ["dense0.w", "dense0.b"]
    for name, values in frame.tensors.items():
        assert back.tensors[name].dtype == np.float32
        np.testing.assert_array_equal(back.tensors[name], values)


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8", "sign", "ternary", "qsgd:4", "topk:0.5"])
def test_decoded_tensors_are_writable_copies(codec) -> None:
    payload = bytearray(encode_frame(dataclasses.replace(WORKED_EXAMPLE, codec=codec)))
    before = bytes(payload)
    back = decode_frame(payload)
    for values in back.tensors.values():
        assert values.flags.writeable and not np.shares_memory(values, np.frombuffer(payload, np.uint8))
        values[...] = 5.0  # must not raise (read-only buffer) nor write into the payload
    assert bytes(payload) == before


def _recrc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:10], "shorter than"),
        (lambda b: b"XXXX" + b[4:], "bad magic"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "CRC"),
        (lambda b: _recrc(b[:4] + b"\x02" + b[5:-4]), "format version"),
        (lambda b: _recrc(b[:5] + b"\x09" + b[6:-4]), "frame kind"),
        (lambda b: _recrc(b[:6] + b"\x07" + b[7:-4]), "codec id"),
        (lambda b: _recrc(b[:7] + b"\x02" + b[8:-4]), "flags"),
        (lambda b: _recrc(b[:-8]), "truncated"),
        (lambda b: _recrc(b[:-4] + b"\x00"), "trailing"),
    ],
)
def test_each_defect_is_named(mutate, message) -> None:
    with pytest.raises(FrameError, match=message):
        decode_frame(mutate(encode_frame(WORKED_EXAMPLE)))


def test_payload_length_must_match_shape() -> None:
    raw = bytearray(encode_frame(WORKED_EXAMPLE)[:-4])
    dims_at = raw.index(b"\x01\x77\x02") + 3
    raw[dims_at : dims_at + 4] = struct.pack("<I", 3)  # shape (3, 2) but 2 values sent
    with pytest.raises(FrameError, match="fp32 payload"):
        decode_frame(_recrc(bytes(raw)))


def test_oversized_frame_is_refused_before_parsing() -> None:
    with pytest.raises(FrameError, match="exceeds the limit"):
        decode_frame(encode_frame(WORKED_EXAMPLE), max_bytes=16)


def test_encoder_refuses_bad_names() -> None:
    with pytest.raises(FrameError, match="tensor name"):
        encode_frame(Frame(kind=FrameKind.COMMIT, base_version=0, tensors={"bad name": np.zeros(1)}))


tensor_dicts = st.dictionaries(
    st.from_regex(r"[a-z][a-z0-9_.]{0,10}", fullmatch=True),
    hnp.arrays(np.float32, hnp.array_shapes(min_dims=0, max_dims=3, max_side=5)),
    max_size=4,
)


@given(tensors=tensor_dicts, version=st.integers(0, 2**64 - 1), seq=st.integers(0, 2**64 - 1))
def test_round_trip_property(tensors, version, seq) -> None:
    frame = Frame(kind=FrameKind.COMMIT, base_version=version, tensors=tensors, device="d1", seq=seq, samples=1)
    back = decode_frame(encode_frame(frame))
    assert (back.base_version, back.seq) == (version, seq)
    for name, values in tensors.items():
        np.testing.assert_array_equal(back.tensors[name], values)


@settings(max_examples=2000)
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_never_crash_the_parser(data) -> None:
    with contextlib.suppress(FrameError):
        decode_frame(data)


@settings(max_examples=1000)
@given(position=st.integers(0, 67), value=st.integers(0, 255))
def test_any_single_byte_change_with_a_valid_crc_is_parsed_or_refused(position, value) -> None:
    body = bytearray(encode_frame(WORKED_EXAMPLE)[:-4])
    body[position] = value
    with contextlib.suppress(FrameError):
        decode_frame(_recrc(bytes(body)))


SHAPES = {"dense0.w": (64, 64), "dense0.b": (64,), "dense1.w": (64, 10), "dense1.b": (10,)}


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8", "sign", "ternary", "qsgd:16", "topk:0.01"])
def test_a_compact_commit_carries_the_model_in_one_payload_and_reads_back_in_its_order(codec) -> None:
    from schemas.codecs import make_codec
    from schemas.frame import encode_compact, parse_frame

    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    vector = np.concatenate([t.ravel() for t in tensors.values()])
    payload = make_codec(codec).encode_compact(vector, np.random.default_rng(1))
    frame = Frame(FrameKind.COMMIT, 3, tensors, "dev-01", 7, 32, 1, codec)
    compact = encode_compact(frame, payload)
    raw = parse_frame(compact)
    assert raw.compact is not None and raw.tensors == 4 and raw.records == [] and raw.matches(SHAPES)
    decoded = decode_frame(compact, shapes=SHAPES)
    expected = make_codec(codec).decode_compact(payload, vector.size)
    np.testing.assert_array_equal(np.concatenate([t.ravel() for t in decoded.tensors.values()]), expected)
    assert list(decoded.tensors) == list(SHAPES) and decoded.seq == 7 and decoded.codec == codec
    regular = encode_frame(dataclasses.replace(frame, tensors=tensors), np.random.default_rng(1))
    assert len(compact) < len(regular)  # no names, shapes or u32 lengths: 76 bytes fewer for this model


def test_top_k_compact_reaches_a_hundred_times_fewer_bytes_than_fp32() -> None:
    """The demo's model (4,810 values): topk:0.01 in a compact commit is 19,369 / 160 bytes."""
    from schemas.codecs import make_codec
    from schemas.frame import encode_compact

    tensors = {
        name: np.random.default_rng(2).standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()
    }
    frame = Frame(FrameKind.COMMIT, 3, tensors, "dev-01", 7, 32, 1, "topk:0.01")
    vector = np.concatenate([t.ravel() for t in tensors.values()])
    compact = encode_compact(frame, make_codec("topk:0.01").encode_compact(vector))
    fp32 = encode_frame(dataclasses.replace(frame, codec="fp32"))
    assert len(fp32) / len(compact) >= 100


def test_a_compact_commit_is_refused_where_it_cannot_be_read() -> None:
    from schemas.codecs import make_codec
    from schemas.frame import COMPACT, encode_compact

    tensors = {name: np.ones(shape, np.float32) for name, shape in SHAPES.items()}
    vector = np.ones(4810, np.float32)
    frame = Frame(FrameKind.COMMIT, 3, tensors, "dev-01", 7, 32, 1, "topk:0.01")
    compact = encode_compact(frame, make_codec("topk:0.01").encode_compact(vector))
    with pytest.raises(FrameError, match="needs the model's shapes"):
        decode_frame(compact)  # it names no tensors
    with pytest.raises(FrameError, match="needs the model's shapes"):
        decode_frame(compact, shapes={"w": (4810,)})  # one tensor where the frame counts four
    with pytest.raises(FrameError, match="compact payload"):
        decode_frame(compact, shapes={**SHAPES, "dense0.w": (64, 80)})  # k follows from n: 49 is not 59
    params = bytearray(compact)
    params[5] = FrameKind.PARAMS  # only a commit may be compact
    with pytest.raises(FrameError, match="only a commit may be compact"):
        decode_frame(_recrc(bytes(params[:-4])))
    assert compact[7] == COMPACT


def test_the_compact_worked_example_of_the_protocol() -> None:
    """docs/PROTOCOL.md §4's compact example: device dev-01, seq 7, base 3, 32 samples, one step,
    the model w (1, 2) and b (1,) as fp32 [1.0, -2.5, 0.5] in one payload."""
    from schemas.frame import encode_compact

    tensors = {"w": np.array([[1.0, -2.5]], np.float32), "b": np.array([0.5], np.float32)}
    frame = Frame(FrameKind.COMMIT, 3, tensors, "dev-01", 7, 32, 1, "fp32")
    compact = encode_compact(frame, np.array([1.0, -2.5, 0.5], np.float32).tobytes())
    assert compact.hex() == EXAMPLE_COMPACT
    decoded = decode_frame(compact, shapes={"w": (1, 2), "b": (1,)})
    np.testing.assert_array_equal(decoded.tensors["w"], [[1.0, -2.5]])


EXAMPLE_COMPACT = (
    "45505346010100010000000003000000000000000700000000000000200000000100000006"
    "6465762d303102000c0000803f000020c00000003f33f87cc8"
)
