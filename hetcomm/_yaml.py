"""YAML loading that remembers where every value came from, with bounds on what a file may cost.

Config errors must name the file, line and dotted key (``nodes[1].nics[0].gbps``). PyYAML's
``safe_load`` forgets line numbers, so we compose the node graph ourselves and record the line of
every key and list item while converting to plain Python objects.

Composing ourselves also makes us responsible for what ``safe_load`` would have guarded against,
and for what it does not guard against at all. Every cluster file reaches every rank through
``$HETCOMM_CLUSTER``, so a hostile or broken file must end in a :class:`ConfigError` (CLI exit 2)
naming the file and line, quickly and in bounded memory:

* the file is read with a cap (:data:`MAX_YAML_BYTES`) and must be UTF-8 or UTF-16 with a BOM
  (:mod:`hetcomm._input`);
* aliases are shared nodes in the composed graph; expanding them is what a "billion laughs" file
  exploits (10 levels x 10 aliases in 520 bytes expand to 10^10 values), so the conversion counts
  the values it produces by expanding an alias and stops at :data:`MAX_ALIAS_VALUES`, and every
  value at :data:`MAX_YAML_VALUES`;
* an alias inside its own anchor (``a: &d [*d]``) is a cycle: refused, not recursed into;
* nesting deeper than :data:`MAX_YAML_DEPTH` is refused (libyaml stops at 1000 levels, which
  would already exhaust Python's recursion limit);
* keys must be plain scalars: a complex key (``? [a, b]``) has no dotted name to report;
* a scalar that its tag cannot construct (``!!int abc``, ``!!binary`` garbage,
  ``!!python/object``) names its line.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Optional, Set

import yaml

from hetcomm._input import decode_text, read_bounded
from hetcomm.errors import ConfigError

__all__ = [
    "SourcedYaml",
    "load_yaml",
    "load_yaml_text",
    "reject_unknown_keys",
    "MAX_YAML_BYTES",
    "MAX_YAML_VALUES",
    "MAX_ALIAS_VALUES",
    "MAX_YAML_DEPTH",
]

#: Largest YAML file read: shipped cluster files are ~2 KB; composing 256 KiB takes about a
#: second on a loaded 2-core machine with libyaml (several without).
MAX_YAML_BYTES = 256 << 10
#: Most values (mappings, lists and scalars, every alias expansion counted) one document may
#: expand to: a backstop, as a 256 KiB file holds at most ~131,000 values plus the alias cap.
MAX_YAML_VALUES = 200_000
#: Most values produced by expanding aliases (a NIC list reused by 8 groups is ~50); a 520-byte
#: alias bomb is 10^10. Kept small so that a bomb stops within milliseconds.
MAX_ALIAS_VALUES = 10_000
#: Deepest nesting of mappings and lists (cluster files need 5).
MAX_YAML_DEPTH = 64

# libyaml's composer is ~4x faster than PyYAML's pure-Python one, keeps the same marks and stops
# at a nesting depth of 1000 by itself; fall back when PyYAML was built without it.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


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
        ConfigError: the file is missing, unreadable, not a regular file, larger than
            :data:`MAX_YAML_BYTES`, not UTF-8/UTF-16 text, empty, not valid YAML, or beyond the
            bounds above (each with the file and, where there is one, the line).
    """
    data = read_bounded(
        path,
        limit=MAX_YAML_BYTES,
        error=ConfigError,
        what="YAML file",
        hint="; a cluster file describes node groups, not single nodes (use count:)",
    )
    text = decode_text(data, path, ConfigError, convert_hint="save it as UTF-8, e.g. 'iconv -f GBK -t UTF-8 in.yaml > out.yaml'")
    return load_yaml_text(text, path)


def load_yaml_text(text: str, path: str = "<text>") -> SourcedYaml:
    """Like :func:`load_yaml` for text already in memory."""
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"YAML text of {len(text)} characters is larger than the {MAX_YAML_BYTES} hetcomm reads", path=path)
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"invalid YAML: {problem}", path=path, line=line) from None
    except RecursionError:  # the pure-Python composer on deep nesting
        raise ConfigError(f"invalid YAML: nested deeper than {MAX_YAML_DEPTH} levels", path=path) from None
    if root is None:
        raise ConfigError("file is empty; expected a YAML mapping", path=path, line=1)
    converter = _Converter(path)
    data = converter.convert(root, "", 0)
    return SourcedYaml(data=data, path=path, lines=converter.lines)


class _Converter:
    """Composed nodes -> plain dicts, lists and scalars, within the bounds of the module doc."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lines: Dict[str, int] = {}
        self.values = 0
        self.alias_values = 0
        self.expanding = 0  # > 0 while inside a node converted before (an alias of it)
        self.done: Set[int] = set()  # ids of the collection nodes converted once already
        self.active: Set[int] = set()  # ids of the collection nodes on the current path
        self.scalars = yaml.SafeLoader("")  # its constructors, for scalars only

    def _error(self, node: yaml.Node, key: str, message: str) -> ConfigError:
        return ConfigError(message, key=key or None, path=self.path, line=node.start_mark.line + 1)

    def convert(self, node: yaml.Node, key: str, depth: int) -> Any:
        self.values += 1
        again = id(node) in self.done
        if again or self.expanding:
            self.alias_values += 1
            if self.alias_values > MAX_ALIAS_VALUES:
                raise self._error(
                    node,
                    key,
                    f"aliases expand to more than {MAX_ALIAS_VALUES:,} values; repeated aliases "
                    f"of aliases (an 'alias bomb') are not accepted: write the values out",
                )
        if self.values > MAX_YAML_VALUES:
            raise self._error(
                node,
                key,
                f"the document expands to more than {MAX_YAML_VALUES:,} values (aliases "
                f"included); repeated aliases of aliases (an 'alias bomb') are not accepted",
            )
        if key:
            self.lines.setdefault(key, node.start_mark.line + 1)
        if isinstance(node, yaml.ScalarNode):
            return self._scalar(node, key)
        if depth >= MAX_YAML_DEPTH:
            raise self._error(node, key, f"nested deeper than {MAX_YAML_DEPTH} levels")
        if id(node) in self.active:
            raise self._error(node, key, "recursive alias: an alias refers to a value that contains it")
        self.active.add(id(node))
        self.expanding += again
        try:
            if isinstance(node, yaml.MappingNode):
                return self._mapping(node, key, depth)
            return [self.convert(v, f"{key}[{i}]", depth + 1) for i, v in enumerate(node.value)]
        finally:
            self.expanding -= again
            self.active.discard(id(node))
            self.done.add(id(node))

    def _mapping(self, node: yaml.MappingNode, key: str, depth: int) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for k_node, v_node in node.value:
            if not isinstance(k_node, yaml.ScalarNode):
                kind = "mapping" if isinstance(k_node, yaml.MappingNode) else "list"
                raise self._error(
                    k_node,
                    key,
                    f"complex key (a {kind} used as a key); keys must be plain names",
                )
            k = k_node.value
            child = f"{key}.{k}" if key else str(k)
            if k in out:
                raise self._error(k_node, child, "duplicate key; each key may appear once")
            self.lines[child] = k_node.start_mark.line + 1
            out[k] = self.convert(v_node, child, depth + 1)
        return out

    def _scalar(self, node: yaml.ScalarNode, key: str) -> Any:
        try:
            return self.scalars.construct_object(node, deep=True)
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e)
            raise self._error(node, key, f"invalid value {node.value[:40]!r}: {problem}") from None
        except (ValueError, TypeError, OverflowError) as e:  # e.g. `!!int abc`, `!!float x`
            raise self._error(node, key, f"invalid value {node.value[:40]!r} for tag {node.tag}: {e}") from None
        finally:
            # The constructor caches every object it built; one converter builds many scalars.
            self.scalars.constructed_objects.clear()
            self.scalars.recursive_objects.clear()


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
