"""The shipped /etc/dsr1d/dsr1d.conf documents every key, and each example in it is valid."""

from __future__ import annotations

import re
from pathlib import Path

from dsr1d.core.config import API_SCHEMA, DAEMON_SCHEMA, load_config

SHIPPED = Path(__file__).resolve().parent.parent / "etc/dsr1d/dsr1d.conf"


def test_every_config_key_is_in_the_shipped_file() -> None:
    keys = set(re.findall(r"^#?(\w+) =", SHIPPED.read_text(), re.M))
    assert keys == set(DAEMON_SCHEMA) | set(API_SCHEMA)


def test_the_shipped_file_parses_with_every_example_uncommented(tmp_path: Path) -> None:
    text = re.sub(r"^#(\w+ =)", r"\1", SHIPPED.read_text(), flags=re.M)
    path = tmp_path / "dsr1d.conf"
    path.write_text(text)
    config = load_config(path)
    assert config.model and config.model.endswith(".gguf")
    assert config.engine_cpus == list(range(16)) and config.engine_ping_timeout_s == 30
    assert load_config(SHIPPED).model is None  # as shipped: no engine until a model is set
    assert (config.api_tcp, config.api_keys_file) == ("127.0.0.1:8080", "/etc/dsr1d/api-keys")
    assert load_config(SHIPPED).api_tcp == ""  # as shipped: the unix socket only
