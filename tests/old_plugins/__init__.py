"""Frozen copies of plugins written against earlier interface versions, the project's own "old
plugins": ``tests/test_old_plugins.py`` registers them in-process and runs today's contracts on
them. Each must pass, or be refused — whole when it registers, or per layer with the reason — and
never run wrong. ``OLD_PLUGINS``: plugin name -> module; add a kind's old plugin here and its
contract run there."""

from tests.old_plugins import attention_v1, grammar_v1, kv_connector_v1, models_v1

OLD_PLUGINS = {
    "old-attention-v1": attention_v1,
    "old-models-v1": models_v1,
    "old-kvconnectors-v1": kv_connector_v1,
    "old-grammar-v1": grammar_v1,
}
