"""YAML for configuration files: safe, and refusing duplicate keys.

Plain YAML keeps the last of two equal keys, so a second `alpha:` server or a second `alice:`
user would silently replace the first; a configuration must never lose an entry without
saying so. Used by the roster and the exporter's web config.
"""

from __future__ import annotations

from typing import Any

import yaml


class StrictLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate mapping keys."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    result: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in result:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (line {mark.line + 1})", mark
            )
        result[key] = loader.construct_object(value_node, deep=True)
    return result


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_strict(text: str) -> Any:
    """Parse YAML text safely; raises `yaml.YAMLError` (duplicate keys included)."""
    return yaml.load(text, Loader=StrictLoader)
