"""The documentation says what is there: the README and docs/ are read against the code.

Every repository path, module, command, flag, setting, metric and plugin method the pages name
exists; every command, setting, metric and plugin method there is, is named; the worked plugin
example is installed (as a distribution with an entry point) and run.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import re
import subprocess
import sys
import tomllib
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import Counter
from pydantic import BaseModel

from cacheproxy import prompt_cache
from cacheproxy.cli.main import build_parser
from cacheproxy.disk import eviction
from cacheproxy.ops.metrics import ProxyMetrics
from cacheproxy.plugins import ENTRY_POINT_GROUPS
from cacheproxy.settings import Settings
from cacheproxy.slots import routing

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 200

# top-level entries of the repository: a token starting with one of these is a path in it
TOP_LEVEL = ("cacheproxy", "plugins", "tests", "config", "systemd", "docs", ".ci")
TOP_LEVEL_NAMES = "|".join(map(re.escape, TOP_LEVEL))
PATH_TOKEN = re.compile(rf"(?<![\w./~<>-])((?:{TOP_LEVEL_NAMES})/[\w./-]*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOTTED = re.compile(r"(?<![\w./-])(cacheproxy(?:_plugins)?(?:\.[A-Za-z_]\w*)+)(?![\w-])")
FILE_SUFFIXES = frozenset({"toml", "env", "db", "service", "md", "py", "gguf", "json", "log"})
# environment variables of the test bed and the tests, not settings
NOT_SETTINGS_ENV = frozenset({"CACHE_DIR", "CHROMIUM", "TEST_DATABASE"})


def text(page: Path) -> str:
    return page.read_text()


def all_text() -> str:
    return "\n".join(text(page) for page in PAGES)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    kept = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(match.group(1)) for match in re.finditer(r"^#+ (.+)$", text(page), re.MULTILINE)}


def code_texts(page_text: str) -> Iterator[str]:
    """The content of every code block line and inline code span, whitespace made single."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", page_text, re.DOTALL | re.MULTILINE)
    for block in blocks:
        yield from block.splitlines()
    outside = re.sub(r"^```[^\n]*\n.*?^```", "", page_text, flags=re.DOTALL | re.MULTILINE)
    for span in re.findall(r"`([^`]+)`", outside):
        yield " ".join(span.split())


# -- paths ------------------------------------------------------------------------------------


def test_every_repository_path_the_pages_name_exists() -> None:
    missing = []
    for page in PAGES:
        for match in PATH_TOKEN.finditer(text(page)):
            path = match.group(1).rstrip(".")
            if not (ROOT / path).exists():
                missing.append(f"{page.name}: {path}")
    assert missing == []


def test_every_link_between_pages_leads_somewhere() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(text(page)):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            if not linked.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def _defines(module_file: Path, name: str) -> bool:
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                return True
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def _resolves(dotted: str) -> bool:
    """A module, or a name defined at the top of one, under the repository."""
    parts = dotted.split(".")
    folder = ROOT / ("plugins" if parts[0] == "cacheproxy_plugins" else "cacheproxy")
    for index, part in enumerate(parts[1:], start=1):
        if (folder / part / "__init__.py").is_file():
            folder = folder / part
        elif (folder / f"{part}.py").is_file():
            rest = parts[index + 1 :]
            return not rest or (len(rest) == 1 and _defines(folder / f"{part}.py", rest[0]))
        else:
            return False
    return True


def test_every_module_the_pages_name_exists() -> None:
    groups = set(ENTRY_POINT_GROUPS.values())
    missing = []
    for page in PAGES:
        for name in DOTTED.findall(text(page)):
            if name in groups or name.rsplit(".", 1)[-1] in FILE_SUFFIXES:
                continue
            if not _resolves(name):
                missing.append(f"{page.name}: {name}")
    assert missing == []


def test_the_path_checks_catch_what_is_gone() -> None:
    assert PATH_TOKEN.findall("see tests/test_embedded_differential.py and ~/.cache/cacheproxy/x")
    assert not (ROOT / "tests/test_embedded_differential.py").exists()
    assert not _resolves("cacheproxy.disk.no_such_module")
    assert not _resolves("cacheproxy.disk.eviction.NoSuchPolicy")
    assert _resolves("cacheproxy.disk.eviction.EvictionPolicy")


def test_every_page_is_reachable_from_the_readme() -> None:
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(text(README))}
    assert {page.resolve() for page in DOCS.glob("*.md")} - linked == set()


def test_the_readme_stays_short_and_keeps_the_test_command() -> None:
    readme = text(README)
    assert readme.count("\n") <= README_MAX_LINES
    # .ci/run runs this, and a newcomer copies it from the README
    assert "pip install -e '.[dev]' && pytest && pytest -m database --database postgresql" in readme
    assert "pip install -e . && cacheproxy serve" in readme  # the main command, with nothing given


# -- commands ---------------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _command_tree(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    for name, sub in _subcommands(parser).items():
        yield (*path, name)
        yield from _command_tree(sub, (*path, name))


def test_every_subcommand_is_documented() -> None:
    documented = all_text()
    commands = [" ".join(("cacheproxy", *path)) for path in _command_tree(build_parser())]
    assert len(commands) > 30  # the walk found the tree
    assert [command for command in commands if command not in documented] == []


WORD = re.compile(r"[a-z][a-z0-9-]*$")
COMMAND_START = re.compile(r"(?<![\w/.-])cacheproxy ")


def _shown_commands() -> Iterator[tuple[str, list[str]]]:
    """Every `cacheproxy ...` command line in the pages' code, as tokens after `cacheproxy`."""
    for page in PAGES:
        for line in code_texts(text(page)):
            line = line.split(" #", 1)[0]
            if line.lstrip().startswith("#"):
                continue  # a comment in a shell block
            for match in COMMAND_START.finditer(line):
                rest = re.split(r"\|\s|&&|;|&$|\)|\\$", line[match.end() :])[0]
                tokens = [token.strip("[]") for token in rest.split()]
                if tokens and WORD.match(tokens[0]) and tokens[0] != "cacheproxy":
                    yield page.name, tokens


def _check_command(tokens: list[str]) -> str | None:
    """What is wrong with `cacheproxy TOKENS`, or None."""
    parser = build_parser()
    words = iter(tokens)
    rest = []
    for token in words:
        choices = _subcommands(parser)
        if not choices:
            rest = [token, *words]
            break
        if token not in choices:
            if WORD.match(token):
                return f"no subcommand {token!r}"
            rest = [token, *words]  # a placeholder (COMMAND, ...): the rest is not checked
            return None
        parser = choices[token]
    known = set(parser._option_string_actions)
    for token in rest:
        option = token.split("=", 1)[0]
        if option.startswith("-") and len(option) > 1 and option not in known:
            return f"no option {option!r}"
    return None


def test_the_commands_the_pages_show_exist() -> None:
    shown = list(_shown_commands())
    assert len(shown) > 40  # the scan found them
    wrong = [
        f"{page}: cacheproxy {' '.join(tokens)}: {problem}"
        for page, tokens in shown
        if (problem := _check_command(tokens))
    ]
    assert wrong == []


def test_the_command_check_catches_a_wrong_one() -> None:
    assert _check_command(["tenants", "set-quota", "ID", "--bytes", "1"]) is None
    assert _check_command(["tenants", "rename", "ID"]) == "no subcommand 'rename'"
    assert _check_command(["bench", "cache", "--no-such-flag"]) == "no option '--no-such-flag'"


def test_every_serve_flag_is_on_the_configuration_page() -> None:
    page = text(DOCS / "configuration.md")
    serve = _subcommands(build_parser())["serve"]
    flags = {option for option in serve._option_string_actions if option not in ("-h", "--help")}
    assert {flag for flag in flags if f"`{flag}" not in page} == set()


# -- settings ---------------------------------------------------------------------------------


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def setting_defaults() -> dict[str, Any]:
    """Every setting as `section.field` (top-level ones bare), with its default (`...` when
    it is computed by a factory that is not a plain empty list or mapping)."""
    settings: dict[str, Any] = {}
    for name, field in Settings.model_fields.items():
        if _is_section(field.annotation):
            for sub_name, sub_field in field.annotation.model_fields.items():
                settings[f"{name}.{sub_name}"] = _default(sub_field)
        else:
            settings[name] = _default(field)
    return settings


def _default(field: Any) -> Any:
    if field.default_factory is None:
        return field.default
    made = field.default_factory()
    return made if made in ([], {}) else ...


def documented_settings() -> dict[str, str]:
    """The configuration page's tables of settings: `section.field` -> its default cell."""
    page = text(DOCS / "configuration.md")
    section_text = page.split("\n## Every setting\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    section = None
    for line in section_text.splitlines():
        if heading := re.match(r"### (.+)$", line):
            named = re.match(r"`\[(\w+)\]`$", heading.group(1))
            section = named.group(1) if named else ""
            continue
        row = re.match(r"\| `(\w+)` +\| (.*?) +\|", line)
        if row and section is not None:
            key = f"{section}.{row.group(1)}" if section else row.group(1)
            assert key not in rows, f"{key} twice on the configuration page"
            rows[key] = row.group(2)
    return rows


def _cell_value(cell: str) -> Any:
    if cell == "unset":
        return None
    literal = re.fullmatch(r"`([^`]+)`", cell)
    if literal is None:
        return ...  # described in words
    try:
        return tomllib.loads(f"value = {literal.group(1)}")["value"]
    except tomllib.TOMLDecodeError:
        return ...


def test_the_configuration_page_names_every_setting_and_no_other() -> None:
    assert set(documented_settings()) == set(setting_defaults())


def test_the_configuration_page_gives_each_default() -> None:
    wrong = []
    for key, cell in documented_settings().items():
        default, shown = setting_defaults()[key], _cell_value(cell)
        if default is ...:
            continue  # computed (state_dir): described
        if shown is ... or shown != (str(default) if isinstance(default, Path) else default):
            wrong.append(f"{key}: page {cell}, settings {default!r}")
    assert wrong == []


SECTIONS = "|".join(
    name for name, field in Settings.model_fields.items() if _is_section(field.annotation)
)
# names that look like settings but are the tracing spans of the request stages
SPAN_NAMES = frozenset({"disk.save", "disk.restore"})


def test_every_setting_the_pages_name_exists() -> None:
    known = set(setting_defaults())
    unknown = []
    for page in PAGES:
        page_text = text(page)
        for section, field in re.findall(rf"`({SECTIONS})\.(\w+)", page_text):
            name = f"{section}.{field}"
            if field not in FILE_SUFFIXES and name not in known and name not in SPAN_NAMES:
                unknown.append(f"{page.name}: {name}")
        for name in re.findall(r"\bCACHEPROXY_([A-Z_]+[A-Z])", page_text):
            key = name.lower().replace("__", ".")
            if name not in NOT_SETTINGS_ENV and key not in known:
                unknown.append(f"{page.name}: CACHEPROXY_{name}")
    assert unknown == []


def test_the_other_environment_variables_the_pages_name_are_read() -> None:
    sources = [*(ROOT / "cacheproxy").rglob("*.py"), *(ROOT / "tests" / "support").rglob("*.py")]
    code = "\n".join(path.read_text() for path in sources)
    assert {name for name in NOT_SETTINGS_ENV if f"CACHEPROXY_{name}" not in code} == set()


# -- metrics ----------------------------------------------------------------------------------


def metric_names() -> set[str]:
    metrics = ProxyMetrics()
    return {
        metric._name + ("_total" if isinstance(metric, Counter) else "")
        for metric in vars(metrics).values()
        if hasattr(metric, "_labelnames")
    }


def test_every_metric_is_on_the_operations_page() -> None:
    page = text(DOCS / "operations.md")
    assert len(metric_names()) > 30
    assert {name for name in metric_names() if f"`{name}`" not in page} == set()


def test_every_metric_the_pages_name_exists() -> None:
    known = metric_names()
    unknown = []
    for page in PAGES:
        for name in re.findall(r"\bcacheproxy_[a-z_]+[a-z]", text(page)):
            if name in ("cacheproxy_plugins",):
                continue
            base = re.sub(r"_(bucket|sum|count|created)$", "", name)
            if base not in known and f"{base}_total" not in known:
                unknown.append(f"{page.name}: {name}")
    assert unknown == []


# -- plugins ----------------------------------------------------------------------------------


def plugin_interfaces() -> dict[str, list[str]]:
    """Each plugin Protocol with the members it asks of a plugin."""
    interfaces = {}
    for module in (routing, eviction, prompt_cache):
        for name, value in vars(module).items():
            if inspect.isclass(value) and typing.Protocol in value.__mro__[1:]:
                if value.__module__ != module.__name__:
                    continue
                members = [
                    member
                    for member in (*vars(value), *getattr(value, "__annotations__", {}))
                    if not member.startswith("_")
                ]
                interfaces[name] = sorted(set(members))
    return interfaces


def test_every_plugin_interface_method_is_documented() -> None:
    page = text(DOCS / "plugins.md")
    interfaces = plugin_interfaces()
    assert {"RoutingPolicy", "EvictionPolicy", "PromptCachePolicy"} <= set(interfaces)
    undocumented = [
        f"{interface}.{member}"
        for interface, members in interfaces.items()
        for member in [interface, *members]
        if f"`{member}`" not in page and f"`{member}(" not in page and f"`{member} " not in page
    ]
    assert undocumented == []


def _examples() -> dict[str, str]:
    page = text(DOCS / "plugins.md")
    blocks = re.findall(
        r"<!-- example: (\S+) -->\n```\w*\n(.*?)^```", page, re.DOTALL | re.MULTILINE
    )
    return dict(blocks)


def _install_as_distribution(examples: dict[str, str], site: Path) -> None:
    """What `pip install .` of the example leaves in site-packages: its module, and a
    dist-info whose entry points are the ones its pyproject.toml declares."""
    project = tomllib.loads(examples["pyproject.toml"])["project"]
    for module in tomllib.loads(examples["pyproject.toml"])["tool"]["setuptools"]["py-modules"]:
        (site / f"{module}.py").write_text(examples[f"{module}.py"])
    dist_name = re.sub(r"[-.]+", "_", project["name"])
    dist_info = site / f"{dist_name}-{project['version']}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    entry_points = "".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items())
        for group, points in project["entry-points"].items()
    )
    (dist_info / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def example_site(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    _install_as_distribution(_examples(), site)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "CACHEPROXY_STATE_DIR": str(tmp_path / "state"),
    }
    env.pop("CACHEPROXY_DATABASE_URL", None)
    return env


def test_the_worked_plugin_example_loads_and_runs(tmp_path: Path, example_site: dict) -> None:
    examples = _examples()
    assert {"keep_restored.py", "pyproject.toml", "try_it.py"} <= set(examples)
    script = tmp_path / "try_it.py"
    script.write_text(examples["try_it.py"])
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=example_site,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "keep-restored chooses: ['old', 'new']" in result.stdout


def test_the_settings_select_the_worked_plugin(tmp_path: Path, example_site: dict) -> None:
    """The settings snippet names the plugin and its options; the archives command builds the
    configured eviction plugin as `serve` does, and refuses a name nobody installed."""
    page = text(DOCS / "plugins.md")
    snippet = re.search(
        r'```toml\n(\[disk\]\neviction = "keep-restored".*?)^```', page, re.S | re.M
    )
    assert snippet, "the page shows how to select the plugin"
    config = tmp_path / "cacheproxy.toml"
    config.write_text(snippet.group(1))
    command = [sys.executable, "-m", "cacheproxy", "archives", "list", "--config", str(config)]
    chosen = subprocess.run(command, capture_output=True, text=True, env=example_site, timeout=120)
    assert chosen.returncode == 0, chosen.stderr
    config.write_text(snippet.group(1).replace('"keep-restored"', '"keep-nothing"'))
    refused = subprocess.run(command, capture_output=True, text=True, env=example_site, timeout=120)
    assert refused.returncode == 2
    assert "unknown eviction plugin 'keep-nothing'" in refused.stderr
    assert "keep-restored" in refused.stderr  # the installed example is among those known
