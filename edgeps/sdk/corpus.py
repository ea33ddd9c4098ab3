"""The hostile corpus: messages built to break the C device (wrapping sizes, numbers beyond
what JSON holds exactly, bad fields), run on the host build and under QEMU."""

from __future__ import annotations

import dataclasses
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from edgeps.sdk.build import make
from edgeps.sdk.qemu import _c_array, run_qemu

CORPUS_INCARNATION, CORPUS_RUN = 4242, 7


def raw_frame(
    kind: int,
    codec: int,
    arg: float,
    base: int,
    seq: int,
    records: list[tuple[str, tuple[int, ...], bytes]],
    device: str = "",
) -> bytes:
    """A tensor frame written field by field (docs/PROTOCOL.md §4), with a valid CRC: one that
    declares what no encoder would write (a tensor of 214 M values in 11 bytes of top-k)."""
    body = struct.pack("<4sBBBBfQQII", b"EPSF", 1, kind, codec, 0, arg, base, seq, 0, 0)
    body += struct.pack("<B", len(device)) + device.encode() + struct.pack("<H", len(records))
    for name, dims, payload in records:
        body += struct.pack("<B", len(name)) + name.encode() + struct.pack(f"<B{len(dims)}I", len(dims), *dims)
        body += struct.pack("<I", len(payload)) + payload
    return body + struct.pack("<I", zlib.crc32(body))


def wrapping_frame() -> bytes:
    """The 105-byte parameter frame of issue 29: an MLP 2748 x 78118 in top-k (one value kept per
    tensor) whose arena, in 32-bit arithmetic, wraps to 7 bytes."""
    topk = struct.pack("<IfB", 1, 1.0, 1) + b"\x00\x01"  # k = 1, scale, gap width 1, gap 0, value 1
    return raw_frame(2, 6, 1e-9, 1, CORPUS_RUN, [("dense0.w", (2748, 78118), topk), ("dense0.b", (78118,), topk)])


def hostile_corpus(incarnation: int = CORPUS_INCARNATION) -> list[tuple[str, bytes, str]]:
    """Messages for device ``d`` of job ``fz`` of that incarnation: a valid Control
    and parameters, then hostile ones, each with the status the SDK must answer (its
    eps_status_name), and last a valid Control again. Every hostile one changes nothing."""
    from learning.model import init_mlp
    from schemas.codecs import make_codec
    from schemas.frame import Frame, FrameKind, encode_compact, encode_frame

    def control(**fields: object) -> str:
        body = {
            "device": "d",
            "run": CORPUS_RUN,
            "incarnation": incarnation,
            "seq_base": 0,
            "max_uncommitted_steps": 8,
            "push_every": 2,
            "lr": 0.1,
            "batch_size": 4,
            "codec": "fp32",
            "pull_codec": "fp32",
            "wait_for_params": True,
            "one_commit_per_version": False,
            "staleness_bound": None,
        } | fields
        return "{" + ",".join(f'"{k}":{_json(v)}' for k, v in body.items()) + "}"

    params = encode_frame(
        Frame(kind=FrameKind.PARAMS, base_version=0, seq=CORPUS_RUN, tensors=init_mlp([8, 4, 3], seed=0))
    )
    bad = "bad message field"
    cases: list[tuple[str, bytes, str]] = [("ctrl", control().encode(), "ok"), ("params", params, "ok")]
    cases += [("params", wrapping_frame(), "buffer too small")]  # refused by its layout, whatever size_t is
    beyond = raw_frame(2, 0, 0.0, 2**63, CORPUS_RUN, [("dense0.w", (8, 4), bytes(128))])
    cases += [("params", beyond, "bad message field")]  # a version no JSON reader holds exactly
    model = init_mlp([8, 4, 3], seed=0)
    vector = np.concatenate([v.ravel() for v in model.values()])
    commit = Frame(kind=FrameKind.COMMIT, base_version=0, tensors=model, device="d", seq=1, samples=4, steps=1)
    compact = encode_compact(
        dataclasses.replace(commit, codec="topk:0.1"), make_codec("topk:0.1").encode_compact(vector)
    )
    cases += [("params", compact, "reserved flags set")]  # a compact commit (1.9) is never parameters
    for field, value in [
        ("run", "-nan"),
        ("run", "NaN"),
        ("lr", "1e39"),
        ("lr", "Infinity"),
        ("lr", "-0.1"),
        ("lr", "1e-400"),
        ("lr", '"0.1"'),
        ("push_every", "4294967297"),
        ("push_every", "0"),
        ("push_every", "2.0"),
        ("batch_size", "65537"),
        ("max_uncommitted_steps", "10000001"),
        ("staleness_bound", "-1"),
        ("seq_base", "9007199254740992"),
        ("incarnation", f"{incarnation}.5"),
        ("run", "1e3"),
        ("wait_for_params", "1"),
        ("codec", "7"),
    ]:
        cases.append(("ctrl", control(**{field: _Raw(value)}).encode(), bad))
    for body in [
        '{"run":7,"slowest_clock":-1,"state":"running"}',
        '{"run":7,"slowest_clock":1e308}',
        '{"run":-nan,"state":"finished"}',
        '{"run":7,"state":"finished",}',
    ]:
        cases.append(("barrier", body.encode(), bad))
    cases += [
        ("notice", b'{"device":"d","seq":NaN,"reason":"evicted"}', bad),
        ("notice", b'{"device":"d","seq":1,"reason":"evicted","x":tru}', bad),
    ]
    cases.append(("ctrl", control(lr=0.05).encode(), "ok"))
    return cases


class _Raw(str):
    """A JSON value written as is (a hostile number)."""


def _json(value: object) -> str:
    import json

    return str(value) if isinstance(value, _Raw) else json.dumps(value)


def corpus_header(workdir: Path, mutations: int) -> Path:
    """corpus.h for the image's CORPUS mode: the hostile corpus, and how many mutations to feed."""
    cases = hostile_corpus()
    largest = max(len(payload) for _, payload, _ in cases)
    lines = [
        "/* written by edgeps/sdk */",
        f"#define CORPUS_INCARNATION {CORPUS_INCARNATION}u",
        f"#define CORPUS_MUTATIONS {mutations}u",
        f"#define CORPUS_MAX_BYTES {largest}u",
    ]
    for i, (_, payload, _) in enumerate(cases):
        lines.append(_c_array(f"C{i}", payload))
    topics = {
        "ctrl": "edgeps/fz/ctrl/d",
        "params": "edgeps/fz/params",
        "barrier": "edgeps/fz/barrier",
        "notice": "edgeps/fz/notice/d",
    }
    entries = ", ".join(f'{{"{topics[t]}", C{i}, sizeof C{i}}}' for i, (t, _, _) in enumerate(cases))
    lines.append(
        f"static const struct {{ const char *topic; const uint8_t *data; uint32_t len; }} MESSAGES[] = {{{entries}}};"
    )
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "corpus.h").write_text("\n".join(lines) + "\n")
    return workdir


def corpus_on_qemu(workdir: Path, mutations: int = 20000) -> dict[str, Any]:
    """The hostile corpus fed to the Cortex-M4F image under QEMU, then ``mutations`` mutated copies:
    each message's verdict (eps_status_name), what the corpus expects, how many mutations ran."""
    corpus_header(workdir, mutations)
    make(workdir / "build", "m4-corpus", CORPUS_DIR=workdir, ARENA_BYTES=65536)
    lines = run_qemu(workdir / "build" / "m4-corpus.elf")
    verdicts = [line.split(" ", 2)[2] for line in lines if line.startswith("V ")]
    fuzzed = [int(line.split()[1]) for line in lines if line.startswith("FUZZED ")]
    stack = [int(line.split()[1]) for line in lines if line.startswith("STACK ")]
    return {
        "ok": lines[-1:] == ["DONE"],
        "verdicts": verdicts,
        "expected": [c[2] for c in hostile_corpus()],
        "fuzzed": fuzzed[0] if fuzzed else 0,
        "logs": [line for line in lines if line.startswith("LOG ")],
        "stack_peak_bytes": stack[0] if stack else None,
        "tail": lines[-3:],
    }
