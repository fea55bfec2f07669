"""`bench report --token-scale`: the W1-W3 token counts scaled, their shapes kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from cacheproxy.bench.report import ReportOptions
from cacheproxy.bench.workloads import MultiTurnSpec, SharedPrefixSpec


def test_token_scale_shortens_the_texts_and_keeps_the_shapes(tmp_path: Path) -> None:
    options = ReportOptions(out_dir=tmp_path, workloads=("W1", "W2", "W3"), token_scale=0.25)
    config = options.cache_config()
    assert config is not None
    full_w1, full_w2 = SharedPrefixSpec(), MultiTurnSpec()
    w1, w2 = config.shared_prefix, config.multi_turn
    assert (w1.groups, w1.prompts_per_group) == (full_w1.groups, full_w1.prompts_per_group)
    assert (w2.tenants, w2.users_per_tenant, w2.turns) == (
        full_w2.tenants,
        full_w2.users_per_tenant,
        full_w2.turns,
    )
    assert w1.prefix_tokens == full_w1.prefix_tokens // 4
    assert w2.history_tokens == full_w2.history_tokens // 4
    assert w2.n_predict == full_w2.n_predict // 4


def test_token_scale_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="token-scale"):
        ReportOptions(out_dir=tmp_path, token_scale=0)
