"""llama.cpp's own llama-server tests, direct and through the proxy: none may pass only direct.

The whole suite takes too long for CI on 2 cores (see docs/testbed.md); these files run here, and
`cacheproxy testbed server-tests` runs them all. A difference that is the proxy's by design is
listed, with its reason, in `cacheproxy.provision.server_tests.BY_DESIGN`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cacheproxy.provision.server_tests import format_report, run_server_tests

# 11 tests: 148 s direct and 433 s through the proxy on a 2-core machine at load 18; the whole
# suite (~410 tests without the slow ones) takes over an hour an arm there.
CI_FILES = ("unit/test_basic.py", "unit/test_tokenize.py")


@pytest.mark.timeout(1800)
def test_no_server_test_passes_direct_but_fails_through_the_proxy(tmp_path: Path) -> None:
    runs, comparison = run_server_tests(CI_FILES, workdir=tmp_path)
    report = format_report(runs, comparison)
    print(report)
    assert comparison.passed_direct > 0, report  # the suite ran, and the local model serves
    assert not comparison.differ, report
    # each server start's temporary files are left in the arm's folder, not the system's
    assert list((tmp_path / "proxy" / "tmp-files").glob("cacheproxy-compat-*")), report
