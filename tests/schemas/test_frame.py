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
        (lambda b: _recrc(b[:7] + b"\x01" + b[8:-4]), "flags"),
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
