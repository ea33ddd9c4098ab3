"""``edgeps bench embedded``: what the C device SDK (edge_client/embedded) costs on a Cortex-M4F and
how it trains in a real job.

* **Image**: the device built for a Cortex-M4F (arm-none-eabi-gcc, hard float, -Os, newlib-nano)
  with every entry point a gateway uses and no data; flash = text + data, static RAM = data + bss
  + a stack reserve of ``STACK_RESERVE`` bytes (the stack grows down from the top of RAM). The
  MQTT stack is not in it: the port's functions are stubs.
* **Arena**: ``eps_device_arena_size`` for each model at batch ``BATCH``, with fp32 commits and
  pulls (compressed pulls add a replica, biased commit codecs a residual: both are reported).
* **QEMU**: the scripted exchange of ports/cortex-m/main.c on QEMU's mps2-an386, checked against
  learning.model on the batches the image drew (``scripted_exchange``).
* **Real jobs** on the demo task (digits, non-IID shards, MLP 64-64-10, bsp) over the project's
  Mosquitto with ``edgeps-device`` processes only, then the same with ``edgeps client`` processes,
  with fp32 and with sign commits and ternary pulls: best accuracy, commits refused, and each device
  process's peak RSS.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SDK = ROOT / "edge_client" / "embedded"
STACK_RESERVE = 8192
BATCH = 32
MODELS = ("64-64-10", "64-32-10")
CODECS = (("fp32", "fp32"), ("sign", "ternary"))  # (commits, pulls) of the real jobs
ARENA_BYTES = 163840  # the scripted image's static arena: more than the demo model needs with any codec


def make(build: Path, *targets: str, **variables: object) -> None:
    """Build ``targets`` of the SDK's Makefile into ``build``; RuntimeError with make's output."""
    command = ["make", "-s", "-C", str(SDK), f"BUILD={build}", *(f"{k}={v}" for k, v in variables.items()), *targets]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building {' '.join(targets)} failed:\n{result.stdout}{result.stderr}")


def build_device(build: Path) -> Path:
    """``edgeps-device`` built into ``build`` (again only if its sources changed); RuntimeError in one
    line if this machine cannot build it."""
    import shutil

    missing = [tool for tool in ("make", "cc") if shutil.which(tool) is None]
    if missing or not Path("/usr/include/mosquitto.h").exists():
        raise RuntimeError("C devices need a C compiler, make and libmosquitto's headers "
                           "(apt-get install gcc make libmosquitto-dev)")  # fmt: skip
    make(build, "edgeps-device")
    return build / "edgeps-device"


def image_size(elf: Path) -> dict[str, int]:
    """``arm-none-eabi-size`` of an image: text, data, bss; flash and RAM as the module says."""
    out = subprocess.run(["arm-none-eabi-size", str(elf)], capture_output=True, text=True, check=True).stdout
    text, data, bss = (int(v) for v in out.splitlines()[1].split()[:3])
    return {"text": text, "data": data, "bss": bss, "flash_bytes": text + data, "ram_bytes": data + bss + STACK_RESERVE}


def arena_bytes(epsf: Path, model: str, codec: str = "fp32", pull: str = "fp32", batch: int = BATCH) -> int:
    out = subprocess.run([str(epsf), "arena", model.replace("-", ","), str(batch), codec, pull], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return int(out)


# ---------------------------------------------------------------- QEMU

RUN, INCARNATION, PUSH_EVERY, LR = 5, 4242, 4, 0.2


def _c_array(name: str, data: bytes) -> str:
    rows = ",\n".join(", ".join(f"0x{b:02x}" for b in data[i : i + 24]) for i in range(0, len(data), 24))
    return f"static const uint8_t {name}[] = {{\n{rows}\n}};\n"


def scripted_exchange(workdir: Path) -> dict[str, Any]:
    """Build the scripted image with the Python reference's messages (a Control, the demo model's
    parameters, an int8 delta, digits data), run it under QEMU and check each commit against
    learning.model on the batches the image drew. ``ok`` and the largest difference found."""
    from learning.data import load_digits
    from learning.model import init_mlp, loss_and_grads
    from schemas.frame import Frame, FrameKind, decode_frame, encode_data_frame, encode_frame
    from schemas.messages import Control

    digits = load_digits()
    x, y = digits.x[:120], digits.y[:120]
    params = init_mlp([64, 64, 10], seed=0)
    rng = np.random.default_rng(1)
    change = {name: (rng.standard_normal(v.shape) * 0.01).astype(np.float32) for name, v in params.items()}
    delta = encode_frame(Frame(kind=FrameKind.DELTA, base_version=1, seq=0, tensors=change, codec="int8"))
    control = Control(device="mcu-0", run=RUN, incarnation=INCARNATION, max_uncommitted_steps=8 * PUSH_EVERY,
                      push_every=PUSH_EVERY, lr=LR, batch_size=BATCH, codec="fp32", pull_codec="int8",
                      wait_for_params=False).to_bytes()  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "script.h").write_text("\n".join([
        "/* written by edgeps/embedded.py */",
        f"#define SCRIPT_INCARNATION {INCARNATION}u",
        f"#define DATA_SAMPLES {len(y)}u",
        f"#define DATA_FEATURES {x.shape[1]}u",
        _c_array("CONTROL", control + b"\0"),
        _c_array("PARAMS", encode_frame(Frame(kind=FrameKind.PARAMS, base_version=0, seq=RUN, tensors=params))),
        _c_array("DELTA", delta),
        _c_array("DATA", encode_data_frame(x, y)),
    ]))  # fmt: skip
    make(workdir / "build", "m4-script", SCRIPT_DIR=workdir, ARENA_BYTES=ARENA_BYTES)
    elf = workdir / "build" / "m4-script.elf"
    qemu = ["qemu-system-arm", "-M", "mps2-an386", "-nographic", "-semihosting", "-kernel", str(elf)]
    run = subprocess.run(qemu, capture_output=True, text=True, timeout=300)
    lines = (run.stdout + run.stderr).splitlines()
    if run.returncode != 0 or not lines or lines[-1] != "DONE":
        return {"ok": False, "detail": "\n".join(lines[-5:])[-1000:]}
    drawn = [int(line.split()[1]) for line in lines if line.startswith("IDX ")]
    commits = [decode_frame(bytes.fromhex(line.split()[2])) for line in lines
               if line.startswith("PUB edgeps/emb/grad/mcu-0 ")]  # fmt: skip
    if len(commits) != 2 or len(drawn) != 2 * PUSH_EVERY * BATCH:
        return {"ok": False, "detail": f"{len(commits)} commits, {len(drawn)} samples drawn"}
    local = {name: v.copy() for name, v in params.items()}
    anchor = {name: v.copy() for name, v in params.items()}
    batches = iter(np.array(drawn).reshape(-1, BATCH))
    worst, headers_ok = 0.0, True
    for phase, commit in enumerate(commits):
        if phase == 1:  # the delta arrives: the replica of version 1 (float32 addition), adopted
            replica = {name: params[name] + decode_frame(delta).tensors[name] for name in params}
            local = {name: replica[name] + (local[name] - anchor[name]) for name in params}
            anchor = {name: v.copy() for name, v in replica.items()}
        for _ in range(PUSH_EVERY):
            batch = next(batches)
            _, grads = loss_and_grads(local, x[batch], y[batch])
            local = {name: local[name] - np.float32(LR) * grads[name] for name in params}
        headers_ok &= (commit.seq, commit.base_version, commit.steps, commit.samples, list(commit.tensors)) == (
            phase + 1,
            phase,
            PUSH_EVERY,
            PUSH_EVERY * BATCH,
            list(params),
        )
        for name in params:
            worst = max(worst, float(np.max(np.abs(commit.tensors[name] - (local[name] - anchor[name])))))
        anchor = {name: v.copy() for name, v in local.items()}
    ok = headers_ok and worst <= 1e-5
    return {"ok": ok, "max_abs_difference": worst, "detail": "" if ok else f"headers ok: {headers_ok}"}


# ---------------------------------------------------------------- a real job


def _hwm_kib(pid: int) -> int | None:
    """The peak RSS of a running process (VmHWM, since its exec), or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(status.split("VmHWM:")[1].split()[0]) if "VmHWM:" in status else None


def real_job(
    kind: str, device_bin: Path | None, broker, shards, workdir: Path, rounds: int, codecs: tuple[str, str]
) -> dict[str, Any]:
    """A bsp job of the demo task with ``kind`` devices (``c``: edgeps-device, ``python``: edgeps
    client), commits and pulls in ``codecs``; best accuracy, commits refused, peak RSS per device."""
    workdir.mkdir(parents=True, exist_ok=True)
    job, report = f"embedded-{kind}-{codecs[0]}-{codecs[1]}", workdir / "metrics.json"
    common = ["--broker", f"{broker.host}:{broker.port}", "--job", job]
    from edgeps.demo import spawn

    server = spawn(["ps", *common, "--rounds", str(rounds), "--min-devices", str(len(shards.devices)),
                    "--eval-data", str(shards.holdout), "--report", str(report), "--codec", codecs[0],
                    "--pull-codec", codecs[1]], workdir / "ps.log")  # fmt: skip
    devices = []
    for i, shard in enumerate(shards.devices):
        log = workdir / f"dev-{i}.log"
        if kind == "c":
            args = [*common, "--device", f"dev-{i}", "--data", str(shard.with_suffix(".epsf")), "--seed", str(i)]
            devices.append(spawn(args, log, program=device_bin))
        else:
            devices.append(spawn(["client", *common, "--device", f"dev-{i}", "--data", str(shard), "--seed", str(i)],
                                 log))  # fmt: skip
    rss = [0] * len(devices)  # sampled while they run (wait4's maxrss would count the forking parent)
    try:
        deadline = time.monotonic() + 600
        while server.poll() is None or any(d.poll() is None for d in devices):
            for i, device in enumerate(devices):
                rss[i] = max(rss[i], _hwm_kib(device.pid) or 0)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job did not end within 600 s; see {workdir}")
            time.sleep(0.05)
        if server.returncode != 0:
            raise RuntimeError(f"the parameter server failed; see {workdir / 'ps.log'}")
    finally:
        for process in [server, *devices]:
            if process.poll() is None:
                process.kill()
    history = json.loads(report.read_text())
    final = history[-1]
    return {
        "devices": kind,
        "codecs": "/".join(codecs),
        "best_accuracy": max(m["accuracy"] for m in history),
        "final_accuracy": final["accuracy"],
        "versions": final["version"],
        "applied": final["applied"],
        "rejected": final["rejected"],
        "peak_rss_kib": rss,
        "exit_codes": [d.returncode for d in devices],
    }


def bench_embedded(rounds: int = 100, devices: int = 8, say=print) -> dict[str, Any]:
    from broker.launcher import start_broker
    from learning.data import Dataset, load_digits
    from learning.prepare import prepare_shards
    from schemas.frame import encode_data_frame

    with tempfile.TemporaryDirectory(prefix="edgeps-embedded-") as tmp:
        root = Path(tmp)
        say("building the Cortex-M4F image, the host tools and edgeps-device ...")
        make(root / "m4", "m4")
        make(root / "host", "all", "edgeps-device")
        image = image_size(root / "m4" / "m4.elf")
        models = {}
        for model in MODELS:
            arena = arena_bytes(root / "host" / "epsf", model)
            models[model] = {
                "flash_bytes": image["flash_bytes"],
                "ram_bytes": image["ram_bytes"],
                "arena_bytes": arena,
                "arena_bytes_sign_ternary": arena_bytes(root / "host" / "epsf", model, "sign", "ternary"),
                "total_ram_bytes": image["ram_bytes"] + arena,
            }
        say("the scripted exchange under QEMU (mps2-an386) ...")
        qemu = scripted_exchange(root / "qemu")
        shards = prepare_shards(load_digits(), root / "data", devices=devices, alpha=0.5, seed=0)
        for shard in shards.devices:
            data = Dataset.load(shard)
            shard.with_suffix(".epsf").write_bytes(encode_data_frame(data.x, data.y))
        jobs = {}
        for codecs in CODECS:
            for kind in ("c", "python"):
                name = f"{kind} {'/'.join(codecs)}"
                say(f"a {rounds}-round bsp job of {devices} {'edgeps-device' if kind == 'c' else 'edgeps client'} "
                    f"processes over Mosquitto, {'/'.join(codecs)} ...")  # fmt: skip
                broker = start_broker(workdir=root / f"broker-{name.replace(' ', '-').replace('/', '-')}")
                try:
                    jobs[name] = real_job(kind, root / "host" / "edgeps-device", broker, shards,
                                          root / name.replace(" ", "-").replace("/", "-"), rounds, codecs)  # fmt: skip
                finally:
                    broker.stop()
    c, python = jobs["c fp32/fp32"], jobs["python fp32/fp32"]
    c_st, python_st = jobs["c sign/ternary"], jobs["python sign/ternary"]
    return {
        "image": image,
        "stack_reserve_bytes": STACK_RESERVE,
        "batch": BATCH,
        "models": models,
        "qemu_ok": qemu["ok"],
        "qemu": qemu,
        "c_best_accuracy": c["best_accuracy"],
        "python_best_accuracy": python["best_accuracy"],
        "c_best_accuracy_sign_ternary": c_st["best_accuracy"],
        "python_best_accuracy_sign_ternary": python_st["best_accuracy"],
        "c_rejected": sum(c["rejected"].values()) + sum(c_st["rejected"].values()),
        "c_rss_kib": max(c["peak_rss_kib"] + c_st["peak_rss_kib"]),
        "python_rss_kib": max(python["peak_rss_kib"] + python_st["peak_rss_kib"]),
        "jobs": jobs,
    }


def format_embedded(report: dict[str, Any]) -> str:
    image = report["image"]
    lines = [
        f"Cortex-M4F image (core, trainer, codecs, JSON, libc/libm; no MQTT stack): flash {image['flash_bytes']:,}"
        f" bytes (text {image['text']:,} + data {image['data']:,}), static RAM {image['ram_bytes']:,} bytes "
        f"(data + bss + a {report['stack_reserve_bytes']:,}-byte stack)",
        f"{'model':<10} {'arena, fp32':>12} {'RAM + arena':>12} {'arena, sign/ternary':>20}",
    ]
    for model, m in report["models"].items():
        lines.append(f"{model:<10} {m['arena_bytes']:>12,} {m['total_ram_bytes']:>12,} "
                     f"{m['arena_bytes_sign_ternary']:>20,}")  # fmt: skip
    qemu = report["qemu"]
    lines.append(
        f"QEMU scripted exchange: {'ok' if qemu['ok'] else 'FAILED ' + qemu['detail']}"
        + (f" (commits within {qemu['max_abs_difference']:.1e} of learning.model)" if qemu["ok"] else "")
    )
    for job in report["jobs"].values():
        refused = ", ".join(f"{k} {v}" for k, v in sorted(job["rejected"].items())) or "none"
        who = "edgeps-device" if job["devices"] == "c" else "edgeps client"
        lines.append(f"{who:<14} {job['codecs']:<13} best {job['best_accuracy']:.4f} final {job['final_accuracy']:.4f}"
                     f"  applied {job['applied']}  refused: {refused}  peak RSS per device "
                     f"{max(job['peak_rss_kib']):,} KiB")  # fmt: skip
    return "\n".join(lines)


def run_bench_embedded(rounds: int, devices: int, json_path: str | None) -> dict[str, Any]:
    from edgeps.report import show

    report = bench_embedded(rounds, devices)
    return show(report, format_embedded(report), json_path)
