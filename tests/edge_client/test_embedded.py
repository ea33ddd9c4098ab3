"""The C device SDK's frame and codecs (edge_client/embedded) against the Python reference,
built with AddressSanitizer and UndefinedBehaviorSanitizer: the same verdict on every frame, the
same floats from every decoder, the same bytes from the deterministic encoders."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from edgeps.sdk.build import SDK, make
from schemas.codecs import typical_error
from schemas.frame import Frame, FrameError, FrameKind, decode_frame, encode_frame

SPECS = [
    "fp32",
    "fp16",
    "int8",
    "sign",
    "ternary",
    "qsgd:1",
    "qsgd:4",
    "qsgd:16",
    "qsgd:127",
    "topk:0.01",
    "topk:0.3",
    "topk:1",
]
SHAPES = [(1,), (7,), (513,), (64, 64), (3, 5, 7), (0,), (1100,)]


@pytest.fixture
def epsf(sdk) -> Path:
    return sdk / "epsf"


@pytest.fixture(params=["64-bit", "32-bit"])
def epsf_both(request) -> Path:
    """epsf as built for this host, and for a 32-bit target (size_t of 32 bits)."""
    return request.getfixturevalue("sdk" if request.param == "64-bit" else "sdk32") / "epsf"


def tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {
        f"t{i}": (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 300.0])).astype(np.float32)
        for i, shape in enumerate(SHAPES)
    }
    out["zeros"] = np.zeros(600, np.float32)
    out["huge"] = np.array([1e5, -7e4, 3.0, 6.1e-5, 5.9e-8, -1e-9], np.float32)  # fp16: clamped, subnormal, zero
    return out


def recode(epsf: Path, tmp_path: Path, payload: bytes, spec: str, seed: int = 1) -> bytes:
    source, target = tmp_path / "in.bin", tmp_path / "out.bin"
    source.write_bytes(payload)
    subprocess.run([str(epsf), "recode", spec, str(source), str(target), str(seed)], check=True)
    return target.read_bytes()


@pytest.mark.parametrize("spec", SPECS)
def test_every_decoder_gives_the_references_floats_bit_for_bit(epsf, tmp_path, spec) -> None:
    frame = Frame(kind=FrameKind.DELTA, base_version=9, seq=8, tensors=tensors(1), codec=spec)
    sent = encode_frame(frame, np.random.default_rng(0))
    reference = decode_frame(sent)
    decoded = decode_frame(recode(epsf, tmp_path, sent, "fp32"))
    assert (decoded.kind, decoded.base_version, decoded.seq) == (FrameKind.DELTA, 9, 8)
    for name, values in reference.tensors.items():
        assert decoded.tensors[name].tobytes() == values.tobytes(), name


@pytest.mark.parametrize("spec", ["fp32", "fp16", "int8", "sign", "topk:0.01", "topk:0.3", "topk:1"])
def test_deterministic_encoders_give_the_references_bytes(epsf, tmp_path, spec) -> None:
    values = tensors(2)
    if spec.startswith("topk"):  # among equal magnitudes either side may keep any: the SDK the first
        values.pop("zeros")
    fp32 = encode_frame(
        Frame(kind=FrameKind.COMMIT, base_version=3, seq=7, samples=32, steps=1, device="dev-01", tensors=values)
    )
    reference = encode_frame(
        Frame(
            kind=FrameKind.COMMIT,
            base_version=3,
            seq=7,
            samples=32,
            steps=1,
            device="dev-01",
            tensors=values,
            codec=spec,
        )
    )
    assert recode(epsf, tmp_path, fp32, spec) == reference


@pytest.mark.parametrize("spec", ["topk:0.01", "topk:0.3", "topk:1", "topk:0.0001"])
def test_the_compact_top_k_commit_is_the_references_byte_for_byte(epsf, tmp_path, spec) -> None:
    """Protocol 1.9: the model's values in one payload, LEB128 gaps (gaps past 127 and 16,383 too)."""
    from schemas.codecs import make_codec
    from schemas.frame import encode_compact

    values = tensors(4)
    values.pop("zeros")  # among equal magnitudes either side may keep any: the SDK the first
    frame = Frame(kind=FrameKind.COMMIT, base_version=3, seq=7, samples=32, steps=1, device="dev-01", tensors=values)
    source, target = tmp_path / "in.bin", tmp_path / "out.bin"
    source.write_bytes(encode_frame(frame))
    subprocess.run([str(epsf), "compact", spec, str(source), str(target)], check=True)
    vector = np.concatenate([v.ravel() for v in values.values()])
    reference = encode_compact(dataclasses.replace(frame, codec=spec), make_codec(spec).encode_compact(vector))
    assert target.read_bytes() == reference
    shapes = {name: v.shape for name, v in values.items()}
    assert decode_frame(reference, shapes=shapes).codec == spec
    checked = subprocess.run([str(epsf), "check", str(target)], capture_output=True, text=True)
    assert checked.stdout.split() == ["ok"]  # the SDK's parser reads it


@pytest.mark.parametrize("spec", ["ternary", "qsgd:1", "qsgd:4", "qsgd:16"])
def test_stochastic_encoders_are_valid_and_unbiased(epsf, tmp_path, spec) -> None:
    x = np.random.default_rng(3).standard_normal(4096).astype(np.float32)
    fp32 = encode_frame(
        Frame(kind=FrameKind.COMMIT, base_version=0, seq=1, samples=1, steps=1, device="d", tensors={"x": x})
    )
    draws = [decode_frame(recode(epsf, tmp_path, fp32, spec, seed)).tensors["x"] for seed in range(1, 41)]
    assert decode_frame(recode(epsf, tmp_path, fp32, spec)).codec == spec
    mean = np.mean(draws, axis=0)
    # unbiased: the mean of 40 draws is off by about the reference's error for one draw / sqrt(40)
    assert np.linalg.norm(mean - x) / np.linalg.norm(x) < 1.5 * typical_error(spec) / np.sqrt(40)


def mutations(seed: int, count: int) -> list[bytes]:
    """Frames the reference writes, then truncated, bit-flipped, with their CRC mended or not, or
    random bytes behind a valid magic."""
    import zlib

    rng = np.random.default_rng(seed)
    good = [
        encode_frame(Frame(kind=FrameKind.DELTA, base_version=1, seq=0, tensors=tensors(s), codec=spec), rng)
        for s, spec in enumerate(SPECS)
    ]
    out = list(good)
    while len(out) < count:
        frame = bytearray(good[int(rng.integers(len(good)))])
        how = int(rng.integers(4))
        if how == 0:
            out.append(bytes(frame[: int(rng.integers(len(frame)))]))
            continue
        for _ in range(int(rng.integers(1, 4))):
            frame[int(rng.integers(len(frame)))] ^= 1 << int(rng.integers(8))
        if how == 2:  # random bytes after the header
            frame[40:] = rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8).tobytes()
        if how >= 1:  # a mended CRC makes the parser look past it
            frame[-4:] = zlib.crc32(bytes(frame[:-4])).to_bytes(4, "little")
        out.append(bytes(frame))
    return out


def test_the_parser_refuses_exactly_what_the_reference_refuses(epsf_both, tmp_path) -> None:
    epsf = epsf_both
    frames = mutations(seed=4, count=3000)
    paths = []
    for i, frame in enumerate(frames):
        paths.append(tmp_path / f"{i}.bin")
        paths[-1].write_bytes(frame)
    verdicts = []
    for start in range(0, len(paths), 500):
        result = subprocess.run(
            [str(epsf), "check", *map(str, paths[start : start + 500])], capture_output=True, text=True
        )
        assert result.returncode in (0, 1), result.stderr  # a sanitizer's report exits otherwise
        verdicts += result.stdout.splitlines()
    assert len(verdicts) == len(frames)
    for frame, verdict in zip(frames, verdicts, strict=True):
        try:
            decode_frame(frame)
            accepted = True
        except FrameError:
            accepted = False
        assert (verdict == "ok") == accepted, (verdict, frame[:48].hex())
    assert 100 < sum(v == "ok" for v in verdicts) < len(verdicts) - 1000  # both kinds well represented


@pytest.mark.parametrize(
    ("sizes", "loss_name"),
    [
        ([64, 64, 10], "cross_entropy"),
        ([64, 32, 10], "cross_entropy"),
        ([8, 16, 16, 3], "cross_entropy"),
        ([5, 2], "cross_entropy"),
        ([6, 16, 1], "mse"),
        ([6, 16, 1], "mae"),
        ([6, 16, 8, 1], "bce"),
    ],
)
def test_one_sgd_step_matches_the_numpy_reference(epsf, tmp_path, sizes, loss_name) -> None:
    from learning.model import init_mlp, loss_and_grads

    rng = np.random.default_rng(sum(sizes))
    params = init_mlp(sizes, seed=len(sizes))
    params = {name: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for name, v in params.items()}
    x = rng.random((32, sizes[0]), dtype=np.float32)
    if loss_name in ("mse", "mae"):
        y = rng.normal(0, 2, 32).astype(np.float32)  # real-valued targets
    else:
        y = rng.integers(0, 2 if loss_name == "bce" else sizes[-1], 32)
    lr = np.float32(0.2)
    loss, grads = loss_and_grads(params, x, y, loss_name)
    expected = {name: params[name] - lr * grads[name] for name in params}
    (tmp_path / "p.bin").write_bytes(encode_frame(Frame(kind=FrameKind.PARAMS, base_version=4, seq=1, tensors=params)))
    batch = {"x": x, "y": y.astype(np.float32)}
    (tmp_path / "b.bin").write_bytes(encode_frame(Frame(kind=FrameKind.PARAMS, base_version=0, tensors=batch)))
    args = [
        str(epsf),
        "train",
        str(tmp_path / "p.bin"),
        str(tmp_path / "b.bin"),
        "0.2",
        str(tmp_path / "o.bin"),
        loss_name,
    ]
    subprocess.run(args, check=True)
    stepped = decode_frame((tmp_path / "o.bin").read_bytes()).tensors
    assert abs(float(stepped.pop("loss")[0]) - loss) < 1e-5
    assert list(stepped) == list(params)
    for name, values in expected.items():
        np.testing.assert_allclose(stepped[name], values, rtol=0, atol=2e-6, err_msg=name)


@pytest.mark.parametrize(
    ("outputs", "labels", "loss_name"),
    [
        (3, [1, 3], "cross_entropy"),
        (3, [1, 1.5], "cross_entropy"),
        (1, [0, 2], "bce"),
        (3, [0.5, 1], "mse"),
        (1, [0.5, float("nan")], "mae"),
        (1, [0, 1], "cross_entropy"),
    ],
)
def test_a_label_or_model_the_loss_does_not_take_changes_nothing(epsf, tmp_path, outputs, labels, loss_name) -> None:
    from learning.model import init_mlp

    params = init_mlp([4, outputs], seed=0)
    (tmp_path / "p.bin").write_bytes(encode_frame(Frame(kind=FrameKind.PARAMS, base_version=0, seq=1, tensors=params)))
    batch = {"x": np.ones((2, 4), np.float32), "y": np.array(labels, np.float32)}
    (tmp_path / "b.bin").write_bytes(encode_frame(Frame(kind=FrameKind.PARAMS, base_version=0, tensors=batch)))
    args = [
        str(epsf),
        "train",
        str(tmp_path / "p.bin"),
        str(tmp_path / "b.bin"),
        "0.2",
        str(tmp_path / "o.bin"),
        loss_name,
    ]
    assert subprocess.run(args, capture_output=True).returncode == 1


def test_a_hundred_thousand_mutated_frames_and_messages_crash_nothing(epsf_both, tmp_path) -> None:
    epsf = epsf_both
    """The C parsers (frame, codecs, JSON) and the device core fed 100,000 mutations of a Control,
    a Barrier, a Notice, a parameter frame and an int8 delta, under ASan and UBSan."""
    from learning.model import init_mlp
    from schemas.messages import Barrier, Control, Notice, RejectReason

    run = 77
    params = init_mlp([64, 16, 10], seed=0)
    corpus = {
        "ctrl.json": Control(
            device="d",
            run=run,
            incarnation=4242,
            max_uncommitted_steps=16,
            push_every=2,
            lr=0.1,
            batch_size=8,
            codec="sign",
            pull_codec="int8",
            wait_for_params=False,
        ).to_bytes(),
        "params.bin": encode_frame(Frame(kind=FrameKind.PARAMS, base_version=0, seq=run, tensors=params)),
        "delta.bin": encode_frame(
            Frame(
                kind=FrameKind.DELTA,
                base_version=1,
                seq=0,
                codec="int8",
                tensors={k: np.full_like(v, 0.01) for k, v in params.items()},
            )
        ),
        "barrier.json": Barrier(
            run=run, round=1, version=1, pace="bsp", state="running", waiting_for=["d"], left=["x"], slowest_clock=2
        ).to_bytes(),
        "notice.json": Notice(device="d", seq=1, reason=RejectReason.RATE_LIMITED, detail="slow down").to_bytes(),
    }
    for name, data in corpus.items():
        (tmp_path / name).write_bytes(data)
    result = subprocess.run(
        [str(epsf), "fuzz", "1", "100000", *(str(tmp_path / n) for n in corpus)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("fuzzed 100000 inputs")


def test_gccs_static_analyzer_finds_nothing_in_the_sdk(tmp_path) -> None:
    make(tmp_path, "lib", CFLAGS="-O2 -fanalyzer")  # -Werror: any finding fails the build


def test_the_lwip_port_compiles_against_debians_lwip_headers(tmp_path) -> None:
    """lwIP's MQTT client (lwip/apps/mqtt.h) is the stack of many MCU SDKs: the port builds with the
    SDK's warnings as errors, and refuses an lwipopts.h without room for five subscriptions."""
    if not Path("/usr/include/lwip/lwip/apps/mqtt.h").exists():
        pytest.fail("the lwIP port's test needs lwIP's headers (apt-get install liblwip-dev)")
    make(tmp_path, "lwip")
    assert (tmp_path / "eps_lwip.o").stat().st_size > 0
    too_few = subprocess.run(
        [
            os.environ.get("CC", "cc"),
            "-std=c99",
            "-I",
            str(SDK / "include"),
            "-isystem",
            "/usr/include/lwip",
            "-c",
            str(SDK / "ports" / "lwip" / "eps_lwip.c"),
            "-o",
            str(tmp_path / "x.o"),
        ],
        capture_output=True,
        text=True,
    )
    assert too_few.returncode != 0 and "MQTT_REQ_MAX_IN_FLIGHT >= 8" in too_few.stderr


def test_the_sensor_ring_example_streams_the_newest_readings(tmp_path) -> None:
    make(tmp_path, "sensor-ring", SAN=1)
    result = subprocess.run([str(tmp_path / "sensor-ring")], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == "sensor ring ok\n", result.stderr
