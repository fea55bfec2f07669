"""llama.cpp's own llama-server test suite, run twice: against llama-server, and through cacheproxy.

The pinned sdist ships the suite (`tools/server/tests`, pytest). Each arm runs it in a scratch copy
of that folder (its tests write `./tmp` and read `../../../models/...`), with
`LLAMA_SERVER_BIN_PATH` pointing at `cacheproxy.provision.proxied_server`, which maps every model
the tests ask for to the local test model and, in the proxy arm, puts `cacheproxy serve` where the
server was expected. Tests that need what the random-weight model cannot give (a story, an
embedding model, a vision projector, a download) fail in both arms; what counts is the difference:
a test that passes direct but not through the proxy, unless `BY_DESIGN` explains why.

`cacheproxy testbed server-tests [FILES...]` runs it and prints the table.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fnmatch
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterable, Sequence
from pathlib import Path

from cacheproxy.provision.cache import llama_cpp_source, say
from cacheproxy.provision.proxied_server import ARM_VARIABLE, BINARY_VARIABLE, MODEL_VARIABLE

ARMS = ("direct", "proxy")

# Python packages the suite imports (its requirements.txt; pinned versions are not needed)
SUITE_REQUIREMENTS = ("requests", "wget", "openai", "filelock", "prometheus_client", "numpy")

# Differences that are the proxy's by design, by test id (fnmatch patterns), with the reason.
BY_DESIGN: dict[str, str] = {
    # The proxy pins every request to a slot it keeps a token-exact table of, and llama-server's
    # unified KV cache (-kvu) empties idle slots whenever a task starts: such an upstream is
    # refused at start-up (upstreams/client.py inspect_upstream).
    "unit/test_completion.py::test_completion_unified*": "unified KV (-kvu) upstream refused",
    "unit/test_kv_keep_only_active.py::*": "unified KV (-kvu) upstream refused",
    # The proxy reads GET /slots to keep its table right, so the stand-in starts the upstream
    # with --slots; with no tenants the proxy passes /slots through (tenants never see it).
    "unit/test_basic.py::test_server_slots": "the proxy needs /slots on its upstream",
    # GET /metrics through the proxy is the server's own answer followed by the proxy's own
    # families (cacheproxy_*), which count every request, the test's GET /props polling among
    # them: two scrapes with requests between them differ there, never in the server's part.
    "unit/test_sleep.py::test_server_sleep_read_only_endpoints": (
        "/metrics adds the proxy's own counters, which count the requests between two scrapes"
    ),
    # At start-up (and when an upstream comes back) the proxy probes the server with a few
    # one-token completions on an idle slot: whether a RAM prompt cache answers pinned requests,
    # whether idle slots are emptied (upstreams/client.py), and with the disk tier the weights'
    # fingerprint. The server counts that work like any other: its prompt and predicted token
    # counters are then higher than the sum of the test's own requests.
    "unit/test_metrics.py::test_metrics_prompt_processed_and_cached": (
        "the server's counters include the proxy's start-up probe completions"
    ),
    "unit/test_metrics.py::test_metrics_predicted_total_matches_requests": (
        "the server's counters include the proxy's start-up probe completions"
    ),
    # Not in the suite, which runs one server: with several upstreams, GET /metrics labels each
    # server's samples with upstream="URL" and merges them, from a scrape on a fixed schedule
    # (upstreams/server_metrics.py): samples of several servers under one name must be told apart,
    # and scraping them all on every scrape of the proxy would reset their throughput windows.
}


@dataclasses.dataclass
class CaseResult:
    outcome: str  # passed | failed | error | skipped
    message: str = ""


@dataclasses.dataclass
class SuiteArmRun:
    arm: str
    seconds: float
    results: dict[str, CaseResult]


@dataclasses.dataclass
class SuiteComparison:
    ran: list[str]
    passed_direct: int
    passed_proxy: int
    differ: list[str]  # pass direct, not through the proxy, not by design
    by_design: list[str]  # pass direct, not through the proxy, explained in BY_DESIGN
    proxy_only: list[str]  # pass through the proxy, not direct


def by_design_reason(test_id: str) -> str | None:
    for pattern, reason in BY_DESIGN.items():
        if fnmatch.fnmatchcase(test_id, pattern):
            return reason
    return None


def suite_folder() -> Path:
    return llama_cpp_source() / "tools" / "server" / "tests"


def missing_requirements() -> list[str]:
    import importlib.util

    return [name for name in SUITE_REQUIREMENTS if importlib.util.find_spec(name) is None]


def prepare_tree(source: Path, root: Path) -> Path:
    """A tree under `root` where the suite's relative paths resolve: the tests folder is a copy
    (the tests write into it), everything else a symlink into the llama.cpp source. Returns the
    copied tests folder."""
    tests = source / "tools" / "server" / "tests"
    levels = [source, source / "tools", source / "tools" / "server"]
    target = root
    for level, keep in zip(levels, ("tools", "server", "tests"), strict=True):
        target.mkdir(parents=True, exist_ok=True)
        for entry in level.iterdir():
            if entry.name != keep and not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry)
        target = target / keep
    shutil.copytree(tests, target, ignore=shutil.ignore_patterns("tmp", "__pycache__"))
    (target / "tmp").mkdir(exist_ok=True)
    (target / f"{NO_PRELOAD_PLUGIN_NAME}.py").write_text(NO_PRELOAD_PLUGIN)
    return target


# Loaded into the suite's pytest with -p: its session fixture starts every preset server once so
# that their Hugging Face downloads happen up front; with the local model there is nothing to
# download, and ten server starts per arm are saved. It also gives a server 300 s to start
# rather than the suite's 60, in both arms alike: on a loaded machine (load 30 on 2 cores) a
# start-up alone can take a minute, and the proxy arm starts two processes, so the start-up
# timeout would compare the machine's load, not the servers' answers.
NO_PRELOAD_PLUGIN = """
import utils


def pytest_configure(config):
    utils.ServerPreset.load_all = staticmethod(lambda: None)
    utils.ServerProcess.start.__defaults__ = (300,)
"""
NO_PRELOAD_PLUGIN_NAME = "cacheproxy_no_preload"


def write_wrapper(folder: Path) -> Path:
    """The executable the suite starts as llama-server."""
    wrapper = folder / "llama-server-wrapper"
    wrapper.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" -m cacheproxy.provision.proxied_server "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return wrapper


def _free_port() -> int:
    from cacheproxy.provision.proxied_server import free_port

    return free_port()


def run_arm(
    arm: str,
    files: Sequence[str],
    workdir: Path,
    binary: Path,
    model: Path,
    keyword: str | None = None,
    slow: bool = False,
    timeout_s: int = 300,
) -> SuiteArmRun:
    """Run the suite's `files` (paths under its folder, e.g. `unit/test_basic.py`) in one arm."""
    root = workdir / arm
    if root.exists():
        shutil.rmtree(root)
    tests = prepare_tree(llama_cpp_source(), root)
    wrapper = write_wrapper(root)
    junit = root / "junit.xml"
    # the servers' temporary files (the proxy's state, a router's preset) stay in the arm's
    # folder, removed with it, rather than one per server start left in the system's
    scratch = root / "tmp-files"
    scratch.mkdir()
    env = {
        **os.environ,
        ARM_VARIABLE: arm,
        BINARY_VARIABLE: str(binary),
        MODEL_VARIABLE: str(model),
        "LLAMA_SERVER_BIN_PATH": str(wrapper),
        "PORT": str(_free_port()),
        "LLAMA_CACHE": str(tests / "tmp"),
        "SLOW_TESTS": "1" if slow else "0",
        "TMPDIR": str(scratch),
    }
    env.pop("PYTEST_ADDOPTS", None)
    # -v: one line per test as it ends, so a run cut short still shows its results in the log
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-rN"]
    command += ["-p", NO_PRELOAD_PLUGIN_NAME]
    command += ["--junitxml", str(junit), "-o", f"timeout={timeout_s}"]
    command += ["-o", "junit_family=xunit1", "-o", "asyncio_default_fixture_loop_scope=function"]
    if not slow:
        command += ["-m", "not slow"]
    if keyword:
        command += ["-k", keyword]
    command += list(files)
    say(f"server tests, {arm} arm: {len(files)} file(s)")
    started = time.monotonic()
    with open(root / "pytest.log", "w") as log:
        subprocess.run(command, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - started
    return SuiteArmRun(arm, seconds, parse_junit(junit) if junit.exists() else {})


def parse_junit(path: Path) -> dict[str, CaseResult]:
    """Test id (`unit/test_x.py::test_y[param]`) -> outcome, from pytest's JUnit XML."""
    results: dict[str, CaseResult] = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        classname = case.get("classname", "")
        file = case.get("file") or classname.replace(".", "/") + ".py"
        test_id = f"{file}::{case.get('name')}"
        result = CaseResult("passed")
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag == "failure" else child.tag
                message = (child.get("message") or child.text or "").strip()
                result = CaseResult(outcome, " ".join(message.split())[:300])
                break
        # a test may show twice (a teardown error after a pass): the worse outcome counts
        if test_id not in results or results[test_id].outcome == "passed":
            results[test_id] = result
    return results


def compare(direct: dict[str, CaseResult], proxy: dict[str, CaseResult]) -> SuiteComparison:
    # a test reported by one arm only (a run cut short) is left out of the comparison
    ran = sorted(set(direct) & set(proxy))

    def passed(results: dict[str, CaseResult], test_id: str) -> bool:
        return test_id in results and results[test_id].outcome == "passed"

    lost = [t for t in ran if passed(direct, t) and not passed(proxy, t)]
    return SuiteComparison(
        ran=ran,
        passed_direct=sum(passed(direct, t) for t in ran),
        passed_proxy=sum(passed(proxy, t) for t in ran),
        differ=[t for t in lost if by_design_reason(t) is None],
        by_design=[t for t in lost if by_design_reason(t) is not None],
        proxy_only=[t for t in ran if passed(proxy, t) and not passed(direct, t)],
    )


def format_report(runs: dict[str, SuiteArmRun], comparison: SuiteComparison) -> str:
    proxy = runs["proxy"].results
    lines = [
        "| ran | pass direct | pass proxy | differ | by design | pass only proxy |",
        "|---|---|---|---|---|---|",
        f"| {len(comparison.ran)} | {comparison.passed_direct} | {comparison.passed_proxy}"
        f" | {len(comparison.differ)} | {len(comparison.by_design)}"
        f" | {len(comparison.proxy_only)} |",
        "",
        "time: " + ", ".join(f"{run.arm} {run.seconds:.0f} s" for run in runs.values()),
    ]
    if comparison.differ:
        lines += ["", "pass direct, not through the proxy:"]
        for test_id in comparison.differ:
            result = proxy.get(test_id, CaseResult("missing", "not run through the proxy"))
            lines.append(f"- {test_id}: {result.outcome}: {result.message}")
    if comparison.by_design:
        lines += ["", "by design:"]
        lines += [f"- {t}: {by_design_reason(t)}" for t in comparison.by_design]
    if comparison.proxy_only:
        lines += ["", "pass only through the proxy:"]
        lines += [f"- {t}" for t in comparison.proxy_only]
    return "\n".join(lines)


def default_files() -> list[str]:
    return sorted(f"unit/{path.name}" for path in (suite_folder() / "unit").glob("test_*.py"))


def run_server_tests(
    files: Iterable[str] = (),
    keyword: str | None = None,
    slow: bool = False,
    workdir: Path | None = None,
    json_path: Path | None = None,
    parallel_arms: bool = False,
) -> tuple[dict[str, SuiteArmRun], SuiteComparison]:
    from cacheproxy.provision.build_server import ensure_llama_server
    from cacheproxy.provision.make_model import ensure_model

    missing = missing_requirements()
    if missing:
        raise RuntimeError(
            "llama.cpp's server tests need " + ", ".join(missing) + " (pip install them)"
        )
    selected = list(files) or default_files()
    binary, model = ensure_llama_server(), ensure_model("small")
    workdir = workdir or Path(tempfile.mkdtemp(prefix="cacheproxy-server-tests-"))

    def run(arm: str) -> SuiteArmRun:
        return run_arm(arm, selected, workdir, binary, model, keyword=keyword, slow=slow)

    if parallel_arms:  # half the wall time; each arm's time then includes the other's load
        with concurrent.futures.ThreadPoolExecutor(len(ARMS)) as pool:
            runs = dict(zip(ARMS, pool.map(run, ARMS), strict=True))
    else:
        runs = {arm: run(arm) for arm in ARMS}
    comparison = compare(runs["direct"].results, runs["proxy"].results)
    if json_path is not None:
        json_path.write_text(
            json.dumps(
                {
                    "seconds": {arm: run.seconds for arm, run in runs.items()},
                    "results": {
                        arm: {t: dataclasses.asdict(r) for t, r in run.results.items()}
                        for arm, run in runs.items()
                    },
                    "comparison": dataclasses.asdict(comparison),
                },
                indent=1,
            )
        )
    return runs, comparison


def main(
    files: Sequence[str],
    keyword: str | None,
    slow: bool,
    workdir: Path | None,
    json_path: Path | None,
    parallel_arms: bool = False,
) -> int:
    """Print the two-arm table; exit 1 when a test passes direct but not through the proxy."""
    runs, comparison = run_server_tests(files, keyword, slow, workdir, json_path, parallel_arms)
    print(format_report(runs, comparison))
    if not comparison.ran:
        print("no test ran", file=sys.stderr)
        return 2
    return 1 if comparison.differ else 0
