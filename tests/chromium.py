"""Headless Chromium for the tests that look at a page as a person would: report.html
(tests/dflash/observe/test_report.py) and MLflow's run page (tests/integration/
test_report_to.py). Without Chromium (Debian's `chromium`) those tests skip, and fail
under DFLASH_REQUIRE_CHROMIUM=1 (CI)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("DFLASH_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium is not installed (DFLASH_REQUIRE_CHROMIUM=1)", pytrace=False)
        pytest.skip("chromium is not installed (Debian package `chromium`)")
    return found


def headless(*args: str) -> subprocess.CompletedProcess[str]:
    flags = "--headless --no-sandbox --disable-gpu --no-first-run --disable-dev-shm-usage".split()
    command = [chromium(), *flags, "--hide-scrollbars", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
