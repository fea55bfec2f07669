"""What the `cacheproxy` subcommands share: exit codes, the `--config` option, loading settings.

Every command module imports this one and none imports another command module, so the CLI has
no import cycle.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cacheproxy.errors import describe_validation_error
from cacheproxy.ops.logs import redact_secrets
from cacheproxy.settings import ConfigFileError, Settings, is_secret_field, load_settings

# the test models `make-model` writes
MODEL_SIZES = ("small", "large", "kv-heavy", "swa", "recurrent")

EXIT_REFUSED = 1
EXIT_BAD_SETTINGS = 2


def add_disk_blocks_option(parser: argparse.ArgumentParser) -> None:
    """A bench's `--disk-blocks` (the proxy's default) or `--no-disk-blocks` (whole files)."""
    parser.add_argument(
        "--disk-blocks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the proxy keeps archives as blocks (disk.blocks, its default; --no-disk-blocks:"
        " whole files)",
    )


def add_proxy_cache_ram_option(parser: argparse.ArgumentParser) -> None:
    """A bench's `--proxy-cache-ram`: the proxy arm's llama-server `--cache-ram` (0 by default,
    as tenants need; llama-server's own default, 8192, is the direct arm's)."""
    parser.add_argument(
        "--proxy-cache-ram",
        type=int,
        default=0,
        help="MiB for the proxy arm's llama-server (the direct arm's: its default 8192)",
    )


def describe_settings_errors(error: ValidationError) -> str:
    """Each problem as `field: rule (got value)`; a secret's value is never shown, and keys in
    any other value (a URL's `?key=` or password) are masked."""
    return describe_validation_error(
        error, "invalid settings", show_input=_shown_setting, one_per_line=True
    )


def _shown_setting(location: tuple[int | str, ...], value: Any) -> str:
    if is_secret_field(location):
        return "value not shown: a secret"
    return f"got {redact_secrets(repr(value))}"


def with_config(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", type=Path, help="TOML settings file (names the database)")
    return parser


def settings_for_command(config: Path | None) -> Settings | None:
    """The settings a file-editing command works with; None (after saying why) if they are bad."""
    try:
        return load_settings(config)
    except ValidationError as exc:
        print(describe_settings_errors(exc), file=sys.stderr)
    except ConfigFileError as exc:
        print(str(exc), file=sys.stderr)
    return None
