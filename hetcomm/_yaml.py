"""YAML loading that remembers where every value came from.

Config errors must name the file, line and dotted key (``nodes[1].nics[0].gbps``). PyYAML's
``safe_load`` forgets line numbers, so we compose the node graph ourselves and record the line of
every key and list item while converting to plain Python objects.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Optional

import yaml

from hetcomm.errors import ConfigError

__all__ = ["SourcedYaml", "load_yaml", "reject_unknown_keys"]


@dataclass
class SourcedYaml:
    """Plain data loaded from YAML plus the 1-based line of each dotted key."""

    data: Any
    path: str
    lines: Dict[str, int] = field(default_factory=dict)

    def line(self, key: str) -> Optional[int]:
        """The line of ``key``, or of its closest parent that has one."""
        while key:
            if key in self.lines:
                return self.lines[key]
            cut = max(key.rfind("."), key.rfind("["))
            key = key[:cut] if cut > 0 else ""
        return None

    def error(self, key: str, message: str) -> ConfigError:
        """A :class:`ConfigError` for ``key`` carrying this file and the key's line."""
        return ConfigError(message, key=key, path=self.path, line=self.line(key))


def load_yaml(path: str) -> SourcedYaml:
    """Read ``path`` as YAML, keeping line numbers.

    Raises:
        ConfigError: the file is missing, unreadable, empty or not valid YAML (with the line of
            the syntax error).
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read file: {e.strerror}", path=path) from None
    return load_yaml_text(text, path)


def load_yaml_text(text: str, path: str = "<text>") -> SourcedYaml:
    """Like :func:`load_yaml` for text already in memory."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"invalid YAML: {problem}", path=path, line=line) from None
    if root is None:
        raise ConfigError("file is empty; expected a YAML mapping", path=path, line=1)
    lines: Dict[str, int] = {}
    data = _convert(root, "", lines, path)
    return SourcedYaml(data=data, path=path, lines=lines)


def _convert(node: yaml.Node, key: str, lines: Dict[str, int], path: str) -> Any:
    if key:
        lines.setdefault(key, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: Dict[str, Any] = {}
        for k_node, v_node in node.value:
            k = k_node.value
            child = f"{key}.{k}" if key else str(k)
            if k in out:
                raise ConfigError(
                    "duplicate key; each key may appear once",
                    key=child,
                    path=path,
                    line=k_node.start_mark.line + 1,
                )
            lines[child] = k_node.start_mark.line + 1
            out[k] = _convert(v_node, child, lines, path)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(v, f"{key}[{i}]", lines, path) for i, v in enumerate(node.value)]
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def reject_unknown_keys(
    src: SourcedYaml, mapping: Dict[str, Any], key: str, allowed: Iterable[str]
) -> None:
    """Raise a :class:`ConfigError` for the first key of ``mapping`` not in ``allowed``.

    The message suggests the closest allowed key ("did you mean 'gbps'?") and lists them all.
    """
    allowed = list(allowed)
    for k in mapping:
        if k not in allowed:
            child = f"{key}.{k}" if key else str(k)
            close = difflib.get_close_matches(str(k), allowed, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise src.error(child, f"unknown key '{k}'; {hint}allowed here: {', '.join(allowed)}")
