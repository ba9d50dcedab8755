"""Typed dataclasses from plain dicts (YAML / JSON), with errors that name the key.

Every recipe section and the model config are dataclasses; this module is the one
place that turns untrusted mappings into them:

* unknown keys fail (``data.seq_lenght: unknown key; known keys: ...``),
* values are checked against the field's annotation (int, float, bool, str,
  Optional[...], List[...], Dict[str, ...], Literal[...], nested dataclasses),
* ints are accepted where floats are expected, never the other way round,
* ``apply_overrides`` parses ``section.key=value`` strings with YAML scalars.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import Any, Dict, Iterable, Literal, Mapping, Type, TypeVar, Union, get_args, get_origin

import yaml

from ms_deepseek.core.errors import UserError

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin is Union:
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        args = get_args(tp)
        return f"mapping of {_type_name(args[1])}" if args else "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it (ints widened to float)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Union:
        return _coerce_union(value, tp, where)
    if origin is Literal:
        if value not in get_args(tp):
            raise UserError(f"{where}: must be one of {', '.join(repr(a) for a in get_args(tp))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where}: expected a list, got {value!r}")
        (item_tp,) = get_args(tp)[:1] or (Any,)
        items = [coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise UserError(f"{where}: expected a mapping, got {value!r}")
        key_tp, val_tp = get_args(tp) or (Any, Any)
        return {coerce(k, key_tp, where): coerce(v, val_tp, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise UserError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if tp in _SCALARS:
        return _SCALARS[tp](value, where)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise UserError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    return value


def _coerce_union(value: Any, tp: Any, where: str) -> Any:
    args = get_args(tp)
    if value is None and type(None) in args:
        return None
    if isinstance(value, float) and not math.isfinite(value):  # before "expected float | null, got inf"
        raise UserError(f"{where}: expected a finite number, got {value!r}")
    others = [a for a in args if a is not type(None)]
    if len(others) == 1 and dataclasses.is_dataclass(others[0]) and isinstance(value, Mapping):
        return coerce(value, others[0], where)  # an optional section: keep its own error message
    errors = []
    for arg in others:
        try:
            return coerce(value, arg, where)
        except UserError as exc:
            errors.append((arg, exc))
    # a list given for a Union with one list alternative: that alternative's error names the item
    lists = [exc for arg, exc in errors if get_origin(arg) in (list, tuple)]
    if isinstance(value, (list, tuple)) and len(lists) == 1:
        raise lists[0]
    raise UserError(f"{where}: expected {_type_name(tp)}, got {value!r}")


def _coerce_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"{where}: expected true or false, got {value!r}")
    return value


def _coerce_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{where}: expected an integer, got {value!r}")
    return value


def _coerce_float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where}: expected a number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an integer beyond float range (10**400)
        raise UserError(f"{where}: {value!r} is out of range") from None
    if not math.isfinite(value):  # YAML .inf / JSON Infinity: no setting means "infinite"
        raise UserError(f"{where}: expected a finite number, got {value!r}")
    return value


def _coerce_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise UserError(f"{where}: expected a string, got {value!r}")
    return value


_SCALARS = {bool: _coerce_bool, int: _coerce_int, float: _coerce_float, str: _coerce_str}


# ------------------------------------------------------------------------------- sane upper bounds
# What a recipe, a config or a command line may ask for. Past these no loop, allocation or plan is attempted
# (``parallel.dp: 10**30`` once made `plan` spin for minutes); each is far beyond any real job.
MAX_DEVICES = 65_536  # NPUs in one job: 8,192 Atlas 800T A2 nodes
MAX_STEPS = 10**9  # optimizer steps, and intervals counted in steps
MAX_BATCH = 2**20  # sequences of a (micro-)batch, accumulation steps, pipeline micro-batches
MAX_TOKENS = 2**20  # tokens of one sequence (DeepSeek-V2's context: 128K)
MAX_SEED = 2**32 - 1  # numpy's and MindSpore's seed range


def _shown(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 20 else f"{float(value):.3g}"


def check_at_most(where: str, value: Any, limit: Union[int, float], what: str) -> None:
    """``value`` (a number, a list of numbers, or None) must not exceed ``limit``: else one line naming ``where``."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, (int, float)) and not isinstance(item, bool) and item > limit:
            raise UserError(f"{where}: {_shown(item)} is more than {limit} ({what})")


def _unknown_key_message(where: str, key: str, known: Iterable[str]) -> str:
    known = sorted(known)
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (
        f"{where}.{key}: unknown key{hint}; known keys: {', '.join(known)}"
        if where
        else f"{key}: unknown key{hint}; known keys: {', '.join(known)}"
    )


def from_dict(cls: Type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise UserError."""
    if not isinstance(data, Mapping):
        raise UserError(f"{where or cls.__name__}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise UserError(_unknown_key_message(where, str(key), fields))
        kwargs[key] = coerce(value, hints[key], f"{where}.{key}" if where else key)
    missing = [
        name
        for name, f in fields.items()
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]  # type: ignore[misc]
    if missing:
        raise UserError(f"{where or cls.__name__}: missing required key(s): {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except UserError:
        raise
    except (TypeError, ValueError) as exc:
        raise UserError(f"{where or cls.__name__}: {exc}") from None


def to_dict(obj: Any) -> Dict[str, Any]:
    """Plain-dict form of a dataclass (nested), for YAML/JSON output."""
    return dataclasses.asdict(obj)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'train.lr=3e-4'`` -> (['train', 'lr'], 0.0003). Values are parsed as YAML scalars."""
    if "=" not in text:
        raise UserError(f"--set {text!r}: expected section.key=value")
    path, raw = text.split("=", 1)
    keys = [k for k in path.strip().split(".") if k]
    if not keys:
        raise UserError(f"--set {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    # YAML reads "3e-4" as a string (no dot); accept it as a number.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") and not value.isalpha() else value
        except ValueError:
            pass
    return keys, value


def apply_overrides(data: Dict[str, Any], overrides: Iterable[str]) -> Dict[str, Any]:
    """Apply ``section.key=value`` strings to a nested dict (in place) and return it."""
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for key in keys[:-1]:
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise UserError(f"--set {text!r}: '{key}' is not a section")
            node = child
        node[keys[-1]] = value
    return data
