"""The site commit on the wire: what an aggregator writes the server reads, and nothing else."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.frame import FrameError
from schemas.messages import MessageError
from schemas.sitecommit import SiteCommit, SiteEntry, encode_site_commit, parse_site_commit

SHAPES = {"w": (3, 2), "b": (2,)}
TENSORS = {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "b": np.array([0.5, -1.0], np.float32)}


def header(**fields) -> SiteCommit:
    values = {
        "site": "a",
        "seq": 3,
        "version": 7,
        "data": 120.0,
        "spread": 2.5,
        "commits": [
            SiteEntry(device="d1", seq=4, base_version=6, samples=60, steps=5, weight=60, norm=0.5),
            SiteEntry(device="d2", seq=9, base_version=7, samples=60, steps=3, weight=60, norm=0.25),
        ],
        **fields,
    }
    return SiteCommit(**values)


def test_a_site_commit_round_trips() -> None:
    parsed, tensors = parse_site_commit(encode_site_commit(header(), TENSORS), SHAPES, 1 << 20)
    assert parsed == header()
    for name, values in TENSORS.items():
        np.testing.assert_array_equal(tensors[name], values)


def test_what_does_not_fit_the_model_or_its_header_is_refused() -> None:
    payload = encode_site_commit(header(), TENSORS)
    with pytest.raises(FrameError, match="do not match"):
        parse_site_commit(payload, {"w": (3, 2), "b": (3,)}, 1 << 20)
    with pytest.raises(FrameError, match="exceeds"):
        parse_site_commit(payload, SHAPES, 100)
    with pytest.raises(FrameError, match="does not fit"):
        parse_site_commit(b"\xff\xff\x00\x00" + payload[4:], SHAPES, 1 << 20)
    twice = {**header().model_dump(), "commits": [header().commits[0].model_dump()] * 2}
    with pytest.raises(MessageError, match="appears twice"):  # a site sums a device's commits into one entry
        SiteCommit.from_bytes(json.dumps(twice).encode())
    # the frame must say what the header says
    other = encode_site_commit(header(seq=4), TENSORS)
    body_length = int.from_bytes(payload[:4], "little")
    spliced = payload[: 4 + body_length] + other[4 + int.from_bytes(other[:4], "little") :]
    with pytest.raises(FrameError, match="differs"):
        parse_site_commit(spliced, SHAPES, 1 << 20)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400), cut=st.integers(0, 2000))
def test_arbitrary_or_truncated_bytes_raise_only_frame_or_message_errors(data, cut) -> None:
    payload = encode_site_commit(header(), TENSORS)
    for candidate in (data, payload[:cut], payload[:cut] + data):
        with contextlib.suppress(FrameError, MessageError):
            parse_site_commit(candidate, SHAPES, 1 << 20)
