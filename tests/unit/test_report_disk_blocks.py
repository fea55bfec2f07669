"""`bench report` (and `bench cache`/`bench agents`): the proxy arms run with archives cut into
blocks unless `--no-disk-blocks`, and the disk they hold is measured once every cut is done."""

from __future__ import annotations

from pathlib import Path

from cacheproxy.bench.report import ReportOptions
from cacheproxy.bench.run_counters import folder_bytes
from cacheproxy.cli.main import build_parser
from cacheproxy.disk.kv_blocks import BLOCKS_DIR


def test_disk_blocks_reaches_every_proxy_arm(tmp_path: Path) -> None:
    """Blocks by default, as the proxy keeps them; whole files when asked for."""
    options = ReportOptions(out_dir=tmp_path, workloads=("W1", "W5"), disk_blocks=False)
    cache, agents = options.cache_config(), options.agents_config()
    assert cache is not None and not cache.disk_blocks
    assert agents is not None and not agents.disk_blocks
    plain = ReportOptions(out_dir=tmp_path, workloads=("W1", "W5"))
    assert plain.cache_config().disk_blocks  # type: ignore[union-attr]
    assert plain.agents_config().disk_blocks  # type: ignore[union-attr]
    for command in (["report", "--out", str(tmp_path)], ["cache"], ["agents"]):
        assert build_parser().parse_args(["bench", *command]).disk_blocks
        assert not build_parser().parse_args(["bench", *command, "--no-disk-blocks"]).disk_blocks


def test_the_disk_held_counts_archive_files_and_block_files_only(tmp_path: Path) -> None:
    (tmp_path / f"a_{'1' * 32}.slot").write_bytes(b"x" * 100)
    (tmp_path / f"r_{'2' * 32}.slot").write_bytes(b"x" * 7)  # a restore's file, not kept
    (tmp_path / BLOCKS_DIR).mkdir()
    (tmp_path / BLOCKS_DIR / f"b_{'3' * 32}.kv").write_bytes(b"x" * 30)
    assert folder_bytes(tmp_path) == (100, 30)
