"""``edgeps bench embedded``: what the C device SDK (edge_client/embedded) costs on a Cortex-M4F and
an RV32IMAC, and how it trains in real jobs.

* **Image**: the device built for a Cortex-M4F (arm-none-eabi-gcc, hard float, -Os, newlib-nano)
  with every entry point a gateway uses and no data, linked for a part with 128 KiB of RAM (160
  KiB with a biased commit codec, whose residual is one more copy of the model), the heap
  forbidden (``heap_forbidden``), the arena a static array and a stack of ``STACK_BYTES``. Flash
  from the link map: the SDK's own code (src/*.c), and the image (the SDK, its libc/libm share and
  the start-up, less semihosting); RAM = .data + .bss as linked (arena and stack included), for
  each model with fp32 commits and pulls and with sign commits and ternary pulls, or "does not fit"
  where the link fails. The MQTT client is not in it: the port's functions are stubs.
* **QEMU**: the scripted exchange of ports/cortex-m/main.c on each board (mps2-an386, riscv32 virt)
  under -icount, checked against learning.model on the batches the image drew
  (``scripted_exchange``): the instructions that receiving the demo model's fp32 parameter frame
  (64 bytes at a time, straight into the arena) and one local step take; the hostile corpus and
  20,000 mutations of it on the Cortex-M4F (``corpus_on_qemu``); the stack's peak over both.
* **Real jobs** on the demo task (digits, non-IID shards, MLP 64-64-10) over the project's
  Mosquitto: bsp with ``edgeps-device`` processes only, then with ``edgeps client`` processes, in
  fp32 and in sign commits with ternary pulls; acbsp sign/ternary with ``edgeps client`` processes;
  and the **firmware jobs**, bsp fp32 and acbsp sign/ternary, whose last four devices are firmware
  images (``edgeps.firmware.build_image``: two per board, the SDK's MQTT client over the UART) under
  QEMU: best accuracy against the all-Python job of the same pace and codecs, commits refused,
  flash and RAM as linked with the MQTT client's buffers.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from edgeps.bench.common import Say
from edgeps.bench.sdkjobs import real_job
from edgeps.firmware import BOARDS, build_image, ram_part_bytes
from edgeps.sdk.build import (
    BATCH,
    CODECS,
    MODELS,
    RAM_BYTES,
    STACK_BYTES,
    arena_bytes,
    heap_forbidden,
    image_size,
    make,
)
from edgeps.sdk.corpus import corpus_on_qemu
from edgeps.sdk.qemu import scripted_exchange
from edgeps.tables import Table

#: the firmware jobs' last devices: two images per board, as the CI job
FIRMWARE_BOARDS = ("mps2-an386", "riscv32-virt", "mps2-an386", "riscv32-virt")
FIRMWARE_DEVICES = len(FIRMWARE_BOARDS)
#: the firmware jobs: (pace, commit codec, pull codec)
FIRMWARE_JOBS = (("bsp", "fp32", "fp32"), ("acbsp", "sign", "ternary"))

# ---------------------------------------------------------------- a real job


def bench_embedded(rounds: int = 100, devices: int = 8, say: Say = print, firmware_rounds: int = 40) -> dict[str, Any]:
    from broker.launcher import start_broker
    from learning.data import Dataset, load_digits
    from learning.prepare import prepare_shards
    from schemas.frame import encode_data_frame

    with tempfile.TemporaryDirectory(prefix="edgeps-embedded-") as tmp:
        root = Path(tmp)
        say("building the host tools, edgeps-device and the Cortex-M4F image for each model ...")
        make(root / "host", "all", "edgeps-device")
        forbidden = heap_forbidden(root / "heap", root / "heap-check")
        models: dict[str, Any] = {}
        image: dict[str, Any] = {}
        for model in MODELS:
            models[model] = {}
            for codecs in CODECS:
                arena = arena_bytes(root / "host" / "epsf", model, codecs[0])
                build = root / f"m4-{model}-{'-'.join(codecs)}"
                try:
                    make(build, "m4", ARENA_BYTES=arena, RAM_BYTES=ram_part_bytes(codecs[0]))
                    linked = image_size(build / "m4.elf")
                    image = image or linked
                    ram: int | None = linked["ram_bytes"]
                except RuntimeError as exc:
                    if "overflowed" not in str(exc):
                        raise
                    ram = None
                models[model]["/".join(codecs)] = {"arena_bytes": arena, "ram_bytes": ram}
        say("the scripted exchange on each board and the hostile corpus under QEMU ...")
        scripted = {board: scripted_exchange(root / f"qemu-{board}", board) for board in BOARDS}
        qemu = scripted["mps2-an386"]
        hostile = corpus_on_qemu(root / "corpus")
        shards = prepare_shards(load_digits(), root / "data", devices=devices, alpha=0.5, seed=0)
        for shard in shards.devices:
            data = Dataset.load(shard)
            shard.with_suffix(".epsf").write_bytes(encode_data_frame(data.x, data.y))
        jobs = {}
        for codecs in CODECS:
            for kind in ("c", "python"):
                name = f"{kind} {'/'.join(codecs)}"
                say(
                    f"a {rounds}-round bsp job of {devices} {'edgeps-device' if kind == 'c' else 'edgeps client'} "
                    f"processes over Mosquitto, {'/'.join(codecs)} ..."
                )
                broker = start_broker(workdir=root / f"broker-{name.replace(' ', '-').replace('/', '-')}")
                try:
                    jobs[name] = real_job(
                        kind,
                        root / "host" / "edgeps-device",
                        broker,
                        shards,
                        root / name.replace(" ", "-").replace("/", "-"),
                        rounds,
                        codecs,
                    )
                finally:
                    broker.stop()
        say(f"a {rounds}-round acbsp job of {devices} edgeps client processes over Mosquitto, sign/ternary ...")
        broker = start_broker(workdir=root / "broker-python-acbsp")
        try:
            jobs["python acbsp sign/ternary"] = real_job(
                "python", None, broker, shards, root / "python-acbsp", rounds, ("sign", "ternary"), pace="acbsp"
            )
        finally:
            broker.stop()
        holdout = Dataset.load(shards.holdout)
        sizes = [holdout.x.shape[1], 64, holdout.classes]
        fw_jobs: dict[str, Any] = {}
        fw_images: dict[str, Any] = {}
        for pace, codec, pull in FIRMWARE_JOBS:
            name = f"firmware {pace} {codec}/{pull}"
            say(
                f"a {firmware_rounds}-round {pace} job of {devices - FIRMWARE_DEVICES} edgeps client processes and "
                f"{FIRMWARE_DEVICES} firmware images under QEMU ({', '.join(FIRMWARE_BOARDS)}; UART on the broker), "
                f"{codec}/{pull} ..."
            )
            images = {}
            for i, board in zip(range(devices - FIRMWARE_DEVICES, devices), FIRMWARE_BOARDS, strict=True):
                data = Dataset.load(shards.devices[i])
                folder = root / "firmware" / f"{pace}-{codec}-dev-{i}"
                built = build_image(
                    folder,
                    board,
                    f"embedded-firmware-{pace}-{codec}-{pull}",
                    f"dev-{i}",
                    data.x.astype("float32"),
                    data.y.astype("float32"),
                    sizes,
                    codec,
                    pull,
                    seed=i,
                )
                fw_images.setdefault(board, {})[f"{codec}/{pull}"] = built
                images[i] = folder
            broker = start_broker(workdir=root / f"broker-{pace}-firmware")
            try:
                fw_jobs[name] = real_job(
                    "firmware",
                    None,
                    broker,
                    shards,
                    root / f"{pace}-firmware-job",
                    firmware_rounds,
                    (codec, pull),
                    images,
                    pace=pace,
                )
            finally:
                broker.stop()
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
        "jobs": {**jobs, **fw_jobs},
        "firmware": {board: firmware_entry(fw_images[board], fw_jobs, jobs, scripted[board]) for board in BOARDS},
    }


def firmware_entry(
    images: dict[str, dict[str, Any]], fw_jobs: dict[str, Any], jobs: dict[str, Any], scripted: dict[str, Any]
) -> dict[str, Any]:
    """One board's figures: its images' jobs (bsp fp32, acbsp sign/ternary: the accuracy is the
    job's, which both boards' images share) against the all-Python jobs of the same pace and
    codecs; its image's flash (code: the SDK with its MQTT client, libc, start-up; the device's
    data apart) and RAM as linked (.data + .bss: the arena, the MQTT client's buffers, the stack)."""
    fp32, st = fw_jobs["firmware bsp fp32/fp32"], fw_jobs["firmware acbsp sign/ternary"]
    python, python_st = jobs["python fp32/fp32"], jobs["python acbsp sign/ternary"]

    def python_best(job: dict[str, Any], versions: int) -> float:  # over as many versions as the firmware job
        return float(max(accuracy for version, accuracy in job["accuracy_by_version"] if version <= versions))

    return {
        "versions": fp32["versions"],
        "best_accuracy": fp32["best_accuracy"],
        "python_best_accuracy": python_best(python, fp32["versions"]),
        "best_accuracy_sign_ternary": st["best_accuracy"],
        "python_best_accuracy_sign_ternary": python_best(python_st, st["versions"]),
        "refused": sum(fp32["rejected"].values()) + sum(st["rejected"].values()),
        "flash_bytes": images["fp32/fp32"]["flash_bytes"],
        "sdk_bytes": images["fp32/fp32"]["sdk_bytes"],
        "ram_bytes": images["fp32/fp32"]["ram_bytes"],
        "ram_bytes_sign_ternary": images["sign/ternary"]["ram_bytes"],
        "rx_bytes": images["fp32/fp32"]["rx_bytes"],
        "rx_bytes_sign_ternary": images["sign/ternary"]["rx_bytes"],
        "step_instructions": scripted.get("step_instructions"),
        "params_frame_instructions": scripted.get("params_frame_instructions"),
    }


def format_embedded(report: dict[str, Any]) -> Table:
    image = report["image"]
    codecs = ["/".join(c) for c in CODECS]
    table = Table(["model", *(f"arena, {c}" for c in codecs), *(f"RAM linked, {c}" for c in codecs)])
    table.before.append(
        f"Cortex-M4F image (no MQTT client), linked for a part with {report['ram_part_bytes']:,} bytes of RAM (160 "
        f"KiB with sign commits), heap "
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
        figures = (
            f" (commits within {qemu['max_abs_difference']:.1e} of learning.model); instructions (-icount): "
            f"receiving the fp32 parameter frame {qemu['params_frame_instructions']:,}, one local step at batch "
            f"{report['batch']} {qemu['step_instructions']:,}"
        )
    table.after.append(f"QEMU scripted exchange: {'ok' if qemu['ok'] else 'FAILED ' + qemu['detail']}{figures}")
    table.after.append(
        f"QEMU hostile corpus (the 105-byte frame, NaN/Inf/out-of-range fields) and 20,000 mutations: "
        f"{'each refused with its reason, no fault' if report['hostile_ok'] else 'FAILED'}"
    )
    for board, fw in report.get("firmware", {}).items():
        table.after.append(
            f"firmware on {board} (QEMU; 2 images per board + Python devices, {fw['versions']} versions): best bsp "
            f"fp32 {fw['best_accuracy']:.4f} "
            f"vs {fw['python_best_accuracy']:.4f} all Python, acbsp sign/ternary {fw['best_accuracy_sign_ternary']:.4f}"
            f" vs {fw['python_best_accuracy_sign_ternary']:.4f}; refused {fw['refused']}; flash {fw['flash_bytes']:,}"
            f" (code, the MQTT client in it; data apart); RAM linked {fw['ram_bytes']:,} fp32 / "
            f"{fw['ram_bytes_sign_ternary']:,} sign/ternary; instructions: a local step {fw['step_instructions']:,}, "
            f"the fp32 snapshot into the arena {fw['params_frame_instructions']:,}"
        )
    for job in report["jobs"].values():
        if job["devices"] == "firmware":  # its line is above; QEMU's RSS is not a device's
            continue
        refused = ", ".join(f"{k} {v}" for k, v in sorted(job["rejected"].items())) or "none"
        who = "edgeps-device" if job["devices"] == "c" else "edgeps client"
        table.after.append(
            f"{who:<14} {job['pace']:<5} {job['codecs']:<13} best {job['best_accuracy']:.4f} final "
            f"{job['final_accuracy']:.4f}  applied {job['applied']}  refused: {refused}  peak RSS per "
            f"device {max(job['peak_rss_kib']):,} KiB"
        )
    return table


def run_bench_embedded(rounds: int, devices: int, json_path: str | None, firmware_rounds: int = 40) -> dict[str, Any]:
    from edgeps.bench.common import show

    report = bench_embedded(rounds, devices, firmware_rounds=firmware_rounds)
    return show(report, format_embedded(report), json_path)
