"""The device core cross-compiled for a Cortex-M4F (arm-none-eabi-gcc, hard float, newlib-nano) and
an RV32IMAC without an FPU (riscv64-unknown-elf-gcc, picolibc, soft float), run under QEMU
(mps2-an386, riscv32 virt; semihosting, -icount): the scripted exchange of edgeps/sdk/qemu.py,
checked step by step against learning.model, with its instruction counts and stack peak; and the
image as a linker counts it: no heap, flash and RAM within a 128 KiB-RAM part's, a too-large arena
a link error."""

from __future__ import annotations

import shutil

import pytest

from edgeps.sdk.build import RAM_BYTES, STACK_BYTES, arena_bytes, heap_forbidden, image_size, make
from edgeps.sdk.qemu import scripted_exchange

TOOLS = {
    "mps2-an386": ("arm-none-eabi-gcc", "qemu-system-arm"),
    "riscv32-virt": ("riscv64-unknown-elf-gcc", "qemu-system-riscv32"),
}


def needs(board: str) -> None:
    missing = [tool for tool in TOOLS[board] if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the {board} tests need {missing} (bash .ci/run installs them)")


@pytest.fixture(scope="module")
def toolchain() -> None:
    needs("mps2-an386")


@pytest.mark.parametrize(
    ("board", "frame_at_most", "step_at_most"),
    [
        ("mps2-an386", 300_000, 3_000_000),  # hard float
        ("riscv32-virt", 900_000, 60_000_000),  # soft float: a step is some 20 times the Cortex-M4F's
    ],
)
def test_the_image_trains_and_commits_as_the_reference(board, frame_at_most, step_at_most, tmp_path) -> None:
    needs(board)
    result = scripted_exchange(tmp_path, board=board)
    assert result["ok"], result
    assert result["max_abs_difference"] <= 1e-5
    # receiving the demo model's fp32 parameters, 64 bytes at a time straight into the arena
    assert result["params_frame_instructions"] <= frame_at_most
    assert result["step_instructions"] <= step_at_most
    assert 500 < result["stack_peak_bytes"] <= STACK_BYTES // 2  # the image's stack: twice this peak


def test_the_image_links_with_the_heap_forbidden(toolchain, tmp_path) -> None:
    assert heap_forbidden(tmp_path / "m4", tmp_path)  # a program that calls malloc does not link; the device does


def test_the_image_fits_a_128_kib_part_as_its_linker_counts(toolchain, tmp_path) -> None:
    make(tmp_path / "host", "all")
    arena = arena_bytes(tmp_path / "host" / "epsf", "64-64-10")
    make(tmp_path / "m4", "m4", ARENA_BYTES=arena)
    image = image_size(tmp_path / "m4" / "m4.elf")
    assert image["sdk_bytes"] + image["libc_bytes"] + image["startup_bytes"] <= 32 * 1024
    assert image["flash_bytes"] <= 32 * 1024
    assert arena + STACK_BYTES < image["ram_bytes"] <= RAM_BYTES  # the arena and the stack are in it
    too_big = arena_bytes(tmp_path / "host" / "epsf", "64-64-10", "sign") + 8 * 1024
    with pytest.raises(RuntimeError, match="region `RAM' overflowed"):
        make(tmp_path / "big", "m4", ARENA_BYTES=too_big)
