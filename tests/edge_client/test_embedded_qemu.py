"""The device core cross-compiled for a Cortex-M4F (arm-none-eabi-gcc, hard float, newlib-nano) and
run under QEMU (mps2-an386, semihosting): the scripted exchange of edgeps/embedded.py, checked
step by step against learning.model; and the image's flash and RAM against the budgets of a
256 KB microcontroller (issue 14)."""

from __future__ import annotations

import shutil

import pytest

from edgeps.embedded import arena_bytes, image_size, make, scripted_exchange


@pytest.fixture(scope="module")
def toolchain() -> None:
    missing = [tool for tool in ("arm-none-eabi-gcc", "qemu-system-arm") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"the Cortex-M tests need {missing} (apt-get install gcc-arm-none-eabi libnewlib-arm-none-eabi "
                    "qemu-system-arm)")  # fmt: skip


def test_the_cortex_m4f_image_trains_and_commits_as_the_reference(toolchain, tmp_path) -> None:
    result = scripted_exchange(tmp_path)
    assert result["ok"], result
    assert result["max_abs_difference"] <= 1e-5


def test_the_image_fits_the_budgets_of_a_256_kb_part(toolchain, tmp_path) -> None:
    make(tmp_path / "m4", "m4")
    make(tmp_path / "host", "all")
    image = image_size(tmp_path / "m4" / "m4.elf")
    assert image["flash_bytes"] <= 64 * 1024  # core, trainer, codecs, JSON and the libc/libm they pull in
    epsf = tmp_path / "host" / "epsf"
    assert image["ram_bytes"] + arena_bytes(epsf, "64-64-10") <= 128 * 1024  # the demo model, batch 32
    assert image["ram_bytes"] + arena_bytes(epsf, "64-32-10") <= 64 * 1024  # the Arduino anchor's budget
