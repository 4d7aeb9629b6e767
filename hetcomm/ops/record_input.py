"""Reading a job's record files (``hetcomm report``, ``hetcomm doctor``): bounded, typed.

Every file is read through :func:`hetcomm._input.read_bounded` and must be a regular file (a FIFO
with no writer, a link to ``/dev/zero`` or another device is refused at once), at most
:data:`MAX_RECORD_BYTES`, and text (UTF-8, or UTF-16 with a byte-order mark; :func:`hetcomm._input.decode_text`). A metrics
line is parsed with JSON's own limits turned into errors (a nesting too deep, a number of
100,000 digits) and checked against its dataclass (:func:`check_fields`: every field's type from
its annotation, times and byte counts finite and not negative), so a bad value is one line
``file:line, key 'k': what is wrong`` (exit 2), never a traceback or a summary of nonsense.

Why by hand: ``json`` and ``dataclasses`` check neither types nor ranges; a schema library would be
a new dependency for ~100 lines.
"""

from __future__ import annotations

import json
import math
import typing
from typing import Any, Dict

from hetcomm._input import decode_text, read_bounded
from hetcomm.errors import ConfigError

__all__ = ["MAX_RECORD_BYTES", "read_record_text", "parse_json_line", "check_fields", "finite_number"]

#: A metrics file is ~1-2 KB per step: 256 MiB is >100k steps; logs are cut there too.
MAX_RECORD_BYTES = 256 << 20
#: Largest magnitude a number in a record may have (a byte count of a long job is ~1e15).
_MAX_ABS = 1e18


def _error(message: str, *, path: str, line=None) -> ConfigError:
    return ConfigError(message, path=path, line=line)


def read_record_text(path: str, what: str = "file") -> str:
    """The text of the record file ``path`` (see the module docstring).

    Raises:
        ConfigError: missing, unreadable, not a regular file, too large, binary or not UTF-8/16.
    """
    data = read_bounded(path, limit=MAX_RECORD_BYTES, error=ConfigError, what=what, refuse_fifo=True)
    return decode_text(data, path, _error)


def parse_json_line(text: str, path: str, line: int) -> Any:
    """``json.loads`` with its limits as errors naming ``path:line``.

    Raises:
        ConfigError: not JSON, nested too deeply, or a number too long to convert.
        json.JSONDecodeError: left to the caller (a torn last line may be skipped).
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise ConfigError("nested too deeply to be a record", path=path, line=line) from None
    except ValueError as e:  # int('1' * 100000): Python's digit limit
        raise ConfigError(f"a number that cannot be read ({str(e)[:80]})", path=path, line=line) from None


def finite_number(value: Any, *, key: str, path: str, line: int, minimum: float = -_MAX_ABS) -> float:
    """``value`` as a finite number within [minimum, 1e18]; else a ConfigError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"expected a number, got {type(value).__name__}", path=path, line=line, key=key)
    if not minimum <= value <= _MAX_ABS or not math.isfinite(value):  # bounds first: a huge int is no float
        bound = "not negative" if minimum == 0 else f">= {minimum:g}"
        raise ConfigError(f"{value!r} is not a finite number {bound} (at most {_MAX_ABS:g})", path=path, line=line,
                          key=key)
    return float(value)


def _check(value: Any, hint: Any, key: str, path: str, line: int, nonneg: bool) -> None:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return
    if origin is typing.Union:
        if value is None and type(None) in args:
            return
        inner = [a for a in args if a is not type(None)]
        return _check(value, inner[0], key, path, line, nonneg)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"expected a whole number, got {type(value).__name__}", path=path, line=line, key=key)
        finite_number(value, key=key, path=path, line=line, minimum=0 if nonneg else -_MAX_ABS)
        return
    if hint is float:
        if isinstance(value, float) and math.isnan(value) and not nonneg:
            return  # a NaN loss is a fact the report states, not a broken file
        finite_number(value, key=key, path=path, line=line, minimum=0 if nonneg else -_MAX_ABS)
        return
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"expected a string, got {type(value).__name__}", path=path, line=line, key=key)
        return
    if origin in (list, typing.List):
        if not isinstance(value, list):
            raise ConfigError(f"expected a list, got {type(value).__name__}", path=path, line=line, key=key)
        for i, v in enumerate(value):
            _check(v, args[0] if args else Any, f"{key}[{i}]", path, line, nonneg)
        return
    if origin in (dict, typing.Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"expected an object, got {type(value).__name__}", path=path, line=line, key=key)
        for k, v in value.items():
            _check(v, args[1] if args else Any, f"{key}.{k}", path, line, nonneg)
        return


#: Fields that count something or measure time: never negative.
_NONNEG_EXCEPT = {"loss"}


def check_fields(cls: type, obj: Dict[str, Any], path: str, line: int) -> None:
    """Check every field of ``obj`` against ``cls``'s annotations (see the module docstring).

    Raises:
        ConfigError: ``file:line, key 'k': what is wrong``.
    """
    hints = typing.get_type_hints(cls)
    for name, value in obj.items():
        if name in hints:
            _check(value, hints[name], name, path, line, nonneg=name not in _NONNEG_EXCEPT)
