"""What the `cacheproxy` subcommands share: exit codes, the `--config` option, loading settings.

Every command module imports this one and none imports another command module, so the CLI has
no import cycle.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from cacheproxy.errors import describe_validation_error
from cacheproxy.settings import ConfigFileError, Settings, load_settings

EXIT_REFUSED = 1
EXIT_BAD_SETTINGS = 2


def describe_settings_errors(error: ValidationError) -> str:
    return describe_validation_error(error, "invalid settings", show_input=True, one_per_line=True)


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
