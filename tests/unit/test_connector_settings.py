"""The connector's settings: declared once (`ConnectorSettings`), read from vLLM's
`kv_connector_extra_config` by `settings.from_keys`, and docs/configuration.md's table of them
generated from the same declaration. tests/connector/test_connector_logic.py::test_settings has the
keys' checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmcache_mp.settings import SettingError, markdown_table
from lmcache_mp.sockets import default_url
from vllm_adapter.connector_common import ConnectorSettings

ROOT = Path(__file__).resolve().parents[2]


def test_the_configuration_pages_connector_settings_table_is_current() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    table = re.search(r"<!-- connector settings table:[^\n]*-->\n(.*?)\n"
                      r"<!-- end of connector settings table -->", page, re.S)
    assert table is not None and table[1] == markdown_table(ConnectorSettings, "lmcache.mp."), \
        "regenerate docs/configuration.md's connector settings table from " \
        "lmcache_mp.settings.markdown_table(ConnectorSettings, 'lmcache.mp.')"


def test_unset_values_take_their_default() -> None:
    for url in (None, ""):
        assert ConnectorSettings.from_extra_config({"lmcache.mp.url": url}).url == default_url()
    assert ConnectorSettings.from_extra_config({"lmcache.mp.timeout_s": None}).timeout_s == 30.0
    assert ConnectorSettings.from_extra_config({"lmcache.mp.save_decode_cache": "on"}).save_decode_cache


def test_a_value_of_the_wrong_kind_names_its_key() -> None:
    with pytest.raises(SettingError, match=r"lmcache\.mp\.timeout_s is 'soon': expected a number"):
        ConnectorSettings.from_extra_config({"lmcache.mp.timeout_s": "soon"})
    with pytest.raises(SettingError, match=r"lmcache\.mp\.timeout_s must be positive, not -1\.0"):
        ConnectorSettings.from_extra_config({"lmcache.mp.timeout_s": -1})
