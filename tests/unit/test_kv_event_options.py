"""The engine's KV-event options are checked when the config is built."""

import pytest

from pagedkv import InvalidConfigError
from pagedkv.config import EngineConfig


def test_kv_event_options_are_checked():
    with pytest.raises(InvalidConfigError, match="kv_events_endpoint"):
        EngineConfig(kv_events_endpoint="tcp://*:5557", enable_prefix_caching=False)
    with pytest.raises(InvalidConfigError, match="kv_events_replay_endpoint"):
        EngineConfig(kv_events_replay_endpoint="tcp://*:5558")
