"""``edgeps bench embedded``: what the C device SDK (edge_client/embedded) costs on a Cortex-M4F and
how it trains in a real job.

* **Image**: the device built for a Cortex-M4F (arm-none-eabi-gcc, hard float, -Os, newlib-nano)
  with every entry point a gateway uses and no data, linked for a part with ``RAM_BYTES`` of RAM,
  the heap forbidden (``heap_forbidden``), the arena a static array and a stack of ``STACK_BYTES``.
  Flash from the link map: the SDK's own code (src/*.c), and the image (the SDK, its libc/libm
  share and the start-up, less semihosting); RAM = .data + .bss as linked (arena and stack
  included), for each model with fp32 commits and pulls and with sign commits and ternary pulls
  (compressed pulls add a replica, biased commit codecs a residual), or "does not fit" where the
  link fails. The MQTT stack is not in it: the port's functions are stubs.
* **QEMU**: the scripted exchange of ports/cortex-m/main.c on QEMU's mps2-an386 under -icount,
  checked against learning.model on the batches the image drew (``scripted_exchange``): the
  instructions that receiving the demo model's fp32 parameter frame and one local step take; the
  hostile corpus and 20,000 mutations of it (``corpus_on_qemu``); the stack's peak over both
  (painted at reset).
* **Real jobs** on the demo task (digits, non-IID shards, MLP 64-64-10, bsp) over the project's
  Mosquitto with ``edgeps-device`` processes only, then the same with ``edgeps client`` processes,
  with fp32 and with sign commits and ternary pulls: best accuracy, commits refused, and each device
  process's peak RSS.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from edgeps.embedded import (
    BATCH,
    CODECS,
    MODELS,
    RAM_BYTES,
    STACK_BYTES,
    arena_bytes,
    corpus_on_qemu,
    heap_forbidden,
    image_size,
    make,
    scripted_exchange,
)
from edgeps.report import read_report
from edgeps.tables import Table

FIRMWARE_BOARDS = ("riscv32-virt", "mps2-an386")  # the firmware job's last devices: one image per board
FIRMWARE_DEVICES = len(FIRMWARE_BOARDS)

# ---------------------------------------------------------------- a real job


def _hwm_kib(pid: int) -> int | None:
    """The peak RSS of a running process (VmHWM, since its exec), or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(status.split("VmHWM:")[1].split()[0]) if "VmHWM:" in status else None


def real_job(
    kind: str,
    device_bin: Path | None,
    broker,
    shards,
    workdir: Path,
    rounds: int,
    codecs: tuple[str, str],
    firmware: dict[int, Path] | None = None,
    boards: dict[int, str] | None = None,
) -> dict[str, Any]:
    """A bsp job of the demo task with ``kind`` devices (``c``: edgeps-device, ``python``: edgeps
    client; ``firmware``: edgeps client but device i of ``firmware``, that image under QEMU),
    commits and pulls in ``codecs``; best accuracy, commits refused, peak RSS per device."""
    firmware = firmware or {}
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
        if i in firmware:
            from edgeps.firmware import run_firmware

            board = (boards or {}).get(i, "mps2-an386")
            devices.append(run_firmware(firmware[i], broker.host, broker.port, log, board=board))
            continue
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
    history = read_report(report)["metrics"]
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
        say("building the host tools, edgeps-device and the Cortex-M4F image for each model ...")
        make(root / "host", "all", "edgeps-device")
        forbidden = heap_forbidden(root / "heap", root / "heap-check")
        models, image = {}, {}
        for model in MODELS:
            models[model] = {}
            for codecs in CODECS:
                arena = arena_bytes(root / "host" / "epsf", model, *codecs)
                build = root / f"m4-{model}-{'-'.join(codecs)}"
                try:
                    make(build, "m4", ARENA_BYTES=arena)
                    linked = image_size(build / "m4.elf")
                    image = image or linked
                    ram: int | None = linked["ram_bytes"]
                except RuntimeError as exc:
                    if "overflowed" not in str(exc):
                        raise
                    ram = None
                models[model]["/".join(codecs)] = {"arena_bytes": arena, "ram_bytes": ram}
        say("the scripted exchange and the hostile corpus under QEMU (mps2-an386) ...")
        qemu = scripted_exchange(root / "qemu")
        hostile = corpus_on_qemu(root / "corpus")
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
        say(f"a {rounds}-round bsp job of {devices - FIRMWARE_DEVICES} edgeps client processes and "
            f"firmware images under QEMU ({', '.join(FIRMWARE_BOARDS)}; UART on the broker), fp32 ...")  # fmt: skip
        from edgeps.firmware import build_firmware

        arena = arena_bytes(root / "host" / "epsf", MODELS[0])
        images, boards = {}, {}
        for i, board in zip(range(devices - FIRMWARE_DEVICES, devices), FIRMWARE_BOARDS, strict=True):
            data = Dataset.load(shards.devices[i])
            images[i] = build_firmware(root / "firmware" / f"dev-{i}", "embedded-firmware-fp32-fp32", f"dev-{i}",
                                       data.x.astype("float32"), data.y.astype("float32"), arena, seed=i,
                                       board=board)  # fmt: skip
            boards[board] = images[i]
        broker = start_broker(workdir=root / "broker-firmware")
        try:
            fw_job = real_job("firmware", None, broker, shards, root / "firmware-job", rounds, ("fp32", "fp32"),
                              images, boards={i: b for i, b in zip(images, FIRMWARE_BOARDS, strict=True)})  # fmt: skip
        finally:
            broker.stop()
        fw_images = {board: image_size(elf) for board, elf in boards.items()}
    c, python = jobs["c fp32/fp32"], jobs["python fp32/fp32"]
    c_st, python_st = jobs["c sign/ternary"], jobs["python sign/ternary"]
    return {
        "image": image,
        "ram_part_bytes": RAM_BYTES,
        "stack_bytes": STACK_BYTES,
        "batch": BATCH,
        "models": models,
        "heap_forbidden_ok": forbidden,
        "m4_flash_sdk_bytes": image["sdk_bytes"],
        "m4_flash_image_bytes": image["flash_bytes"],
        # the deepest of the exchange and of the hostile corpus (refusals say why: a reason on the stack)
        "stack_peak_bytes": max(qemu.get("stack_peak_bytes") or 0, hostile.get("stack_peak_bytes") or 0),
        "hostile_ok": hostile["ok"] and hostile["verdicts"] == hostile["expected"],
        "params_frame_instructions": qemu.get("params_frame_instructions"),
        "step_instructions": qemu.get("step_instructions"),
        "qemu_ok": qemu["ok"],
        "qemu": qemu,
        "c_best_accuracy": c["best_accuracy"],
        "python_best_accuracy": python["best_accuracy"],
        "c_best_accuracy_sign_ternary": c_st["best_accuracy"],
        "python_best_accuracy_sign_ternary": python_st["best_accuracy"],
        "c_rejected": sum(c["rejected"].values()) + sum(c_st["rejected"].values()),
        "c_rss_kib": max(c["peak_rss_kib"] + c_st["peak_rss_kib"]),
        "python_rss_kib": max(python["peak_rss_kib"] + python_st["peak_rss_kib"]),
        "jobs": {**jobs, "firmware fp32/fp32": fw_job},
        "firmware": {  # one job: its accuracy and refusals are both boards'
            board: {
                "best_accuracy": fw_job["best_accuracy"],
                "python_best_accuracy": python["best_accuracy"],
                "refused": sum(fw_job["rejected"].values()),
                "flash_bytes": image["flash_bytes"],  # with the device's data in flash
                "code_bytes": image["sdk_bytes"] + image["libc_bytes"],  # the SDK, its MQTT client, libc
                "ram_bytes": image["ram_bytes"],  # .data + .bss: arena, MQTT receive buffer, stack
                "step_instructions": qemu.get("step_instructions") if board == "mps2-an386" else None,
            }
            for board, image in fw_images.items()
        },
    }


def format_embedded(report: dict[str, Any]) -> Table:
    image = report["image"]
    codecs = ["/".join(c) for c in CODECS]
    table = Table(["model", *(f"arena, {c}" for c in codecs), *(f"RAM linked, {c}" for c in codecs)])
    table.before.append(
        f"Cortex-M4F image (no MQTT stack), linked for a part with {report['ram_part_bytes']:,} bytes of RAM, heap "
        f"forbidden: {'yes' if report['heap_forbidden_ok'] else 'NO'}; flash {image['flash_bytes']:,} bytes (the SDK "
        f"{image['sdk_bytes']:,}, libc/libm/libgcc {image['libc_bytes']:,}, start-up {image['startup_bytes']:,}; "
        f"semihosting {image['board_bytes']:,} not counted); RAM = .data + .bss with the arena and a "
        f"{report['stack_bytes']:,}-byte stack (measured peak {report['stack_peak_bytes']:,} bytes)"
    )
    for model, by_codecs in report["models"].items():
        arenas = [f"{by_codecs[c]['arena_bytes']:,}" for c in codecs]
        rams = [f"{r:,}" if (r := by_codecs[c]["ram_bytes"]) is not None else "does not fit" for c in codecs]
        table.add(model, *arenas, *rams)
    qemu = report["qemu"]
    figures = ""
    if qemu["ok"]:
        figures = (f" (commits within {qemu['max_abs_difference']:.1e} of learning.model); instructions (-icount): "
                   f"receiving the fp32 parameter frame {qemu['params_frame_instructions']:,}, one local step at batch "
                   f"{report['batch']} {qemu['step_instructions']:,}")  # fmt: skip
    table.after.append(f"QEMU scripted exchange: {'ok' if qemu['ok'] else 'FAILED ' + qemu['detail']}{figures}")
    table.after.append(f"QEMU hostile corpus (the 105-byte frame, NaN/Inf/out-of-range fields) and 20,000 mutations: "
                       f"{'each refused with its reason, no fault' if report['hostile_ok'] else 'FAILED'}")  # fmt: skip
    for board, fw in report.get("firmware", {}).items():
        table.after.append(f"firmware on {board} (under QEMU, in a job with one image per board): best "
                           f"{fw['best_accuracy']:.4f} against {fw['python_best_accuracy']:.4f} all Python, refused "
                           f"{fw['refused']}; RAM linked {fw['ram_bytes']:,} (arena, MQTT buffer, stack), code "
                           f"{fw['code_bytes']:,} + the device's data in flash")  # fmt: skip
    for job in report["jobs"].values():
        if job["devices"] == "firmware":  # its line is above; QEMU's RSS is not a device's
            continue
        refused = ", ".join(f"{k} {v}" for k, v in sorted(job["rejected"].items())) or "none"
        who = "edgeps-device" if job["devices"] == "c" else "edgeps client"
        table.after.append(f"{who:<14} {job['codecs']:<13} best {job['best_accuracy']:.4f} final "
                           f"{job['final_accuracy']:.4f}  applied {job['applied']}  refused: {refused}  peak RSS per "
                           f"device {max(job['peak_rss_kib']):,} KiB")  # fmt: skip
    return table


def run_bench_embedded(rounds: int, devices: int, json_path: str | None) -> dict[str, Any]:
    from edgeps.bench.common import show

    report = bench_embedded(rounds, devices)
    return show(report, format_embedded(report), json_path)
