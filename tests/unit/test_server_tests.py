"""The server-suite harness's pure parts: the stand-in's argv rewriting and the comparison."""

from __future__ import annotations

from pathlib import Path

from cacheproxy.provision.proxied_server import flag_value, redirect_models, upstream_argv
from cacheproxy.provision.server_tests import CaseResult, compare, parse_junit

MODEL = "/models/local.gguf"


def test_every_model_source_becomes_the_local_model() -> None:
    argv = ["--port", "8080", "--hf-repo", "ggml-org/models", "--hf-file", "x.gguf", "--seed", "42"]
    assert redirect_models(argv, MODEL) == ["--port", "8080", "--seed", "42", "--model", MODEL]
    assert redirect_models(["-m", "a.gguf", "--model-url", "http://x"], MODEL) == ["--model", MODEL]
    assert redirect_models(["--model-draft", "d.gguf"], MODEL) == ["--model-draft", MODEL]


def test_a_server_without_a_model_is_left_alone() -> None:
    # router mode: the server loads models itself, from --models-dir or a preset
    argv = ["--port", "8080", "--models-max", "2", "--no-slots"]
    assert redirect_models(argv, MODEL) == argv


def test_the_upstream_listens_on_loopback_with_slots_and_keeps_the_rest() -> None:
    argv = ["--port", "8080", "--host", "127.0.0.1,::1", "--no-slots", "--api-key", "k", "-np", "2"]
    upstream = upstream_argv(argv, 9999)
    assert flag_value(upstream, "--host") == "127.0.0.1"
    assert flag_value(upstream, "--port") == "9999"
    assert "--slots" in upstream and "--no-slots" not in upstream
    assert flag_value(upstream, "--api-key") == "k"
    assert flag_value(upstream, "-np") == "2"
    assert flag_value(["--port=1", "--port", "2"], "--port") == "2"


def test_junit_results_are_keyed_by_test_id(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(
        """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite>
        <testcase classname="unit.test_basic" file="unit/test_basic.py" name="test_ok" />
        <testcase classname="unit.test_basic" file="unit/test_basic.py" name="test_bad[4-2]">
          <failure message="assert 502 == 200">trace</failure></testcase>
        <testcase classname="unit.test_basic" file="unit/test_basic.py" name="test_ok">
          <error message="teardown failed" /></testcase>
        <testcase classname="unit.test_more" name="test_skip"><skipped message="no" /></testcase>
        </testsuite></testsuites>"""
    )
    results = parse_junit(junit)
    assert results["unit/test_basic.py::test_bad[4-2]"] == CaseResult("failed", "assert 502 == 200")
    assert results["unit/test_basic.py::test_ok"].outcome == "error"  # the worse outcome counts
    assert results["unit/test_more.py::test_skip"].outcome == "skipped"


def test_only_tests_lost_through_the_proxy_differ_and_by_design_ones_are_set_apart() -> None:
    passed, failed = CaseResult("passed"), CaseResult("failed", "boom")
    direct = {
        "unit/a.py::t1": passed,
        "unit/a.py::t2": passed,
        "unit/a.py::t3": failed,
        "unit/test_completion.py::test_completion_unified[1]": passed,
    }
    proxy = {
        "unit/a.py::t1": passed,
        "unit/a.py::t2": failed,
        "unit/a.py::t3": passed,
        "unit/test_completion.py::test_completion_unified[1]": failed,
    }
    comparison = compare(direct, proxy)
    assert comparison.differ == ["unit/a.py::t2"]
    assert comparison.by_design == ["unit/test_completion.py::test_completion_unified[1]"]
    assert comparison.proxy_only == ["unit/a.py::t3"]
    assert (comparison.passed_direct, comparison.passed_proxy) == (3, 2)


def test_a_test_only_one_arm_reported_is_not_compared() -> None:
    # a run cut short (Ctrl-C) still writes the JUnit file of what it finished
    passed = CaseResult("passed")
    comparison = compare(
        {"unit/a.py::t1": passed, "unit/a.py::t2": passed}, {"unit/a.py::t1": passed}
    )
    assert comparison.ran == ["unit/a.py::t1"]
    assert comparison.differ == []
