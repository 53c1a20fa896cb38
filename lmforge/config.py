"""Typed config sections: defaults < file (TOML or YAML) < `key.sub=value` overrides.

A config is a tree of `Section`s (pydantic models that reject unknown keys); a job config is a
Section whose fields are Sections, and each component receives only its own section.
`load_config` merges the three layers and turns every problem into one `ConfigError` line that
names the dotted key, where it came from (`file:line` or "command line"), the bad value and what
is allowed. `dump_config` prints a resolved config; `config_hash` fingerprints one so the
pipeline can tell whether a stage is up to date.
"""

from __future__ import annotations

import difflib
import enum
import hashlib
import json
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePath
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import pydantic
import tomli_w
import yaml
from pydantic import ConfigDict, Field

from lmforge.errors import ConfigError

CONFIG_EXTENSIONS = (".toml", ".yaml", ".yml")
COMMAND_LINE = "command line"

# A path into a config tree: section/dict keys (str) and list indexes (int).
KeyPath = tuple[str | int, ...]


class Section(pydantic.BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class ModelSection(Section):
    """Which model to start from and how to hold its weights."""

    source: str = "tiny"
    """A preset name, or a path to an HF / Meta / lmforge artifact directory."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    tokenizer: str | None = None
    """Path to a tokenizer; None means the model's own."""
    chat_template: str | None = None
    """A chat template (jinja text, or a path to a .jinja file) replacing the tokenizer's; the
    output artifact carries it."""
    overrides: dict[str, int | float | bool | list[int]] = Field(default_factory=dict)
    """Model-args overrides for tiny experiments, e.g. num_layers=2 or mlp_only_layers=[0]."""


# ----------------------------------------------------------------------------- public API

S = TypeVar("S", bound=Section)


def load_config(
    schema: type[S], path: str | Path | None = None, overrides: Sequence[str] = ()
) -> S:
    """Resolve a config: `schema`'s defaults < the file at `path` < `key.sub=value` overrides.

    Args:
        schema: the Section class to build.
        path: a `.toml`, `.yaml` or `.yml` file, or None for defaults only.
        overrides: items `a.b=value`; a value is read as a TOML value when it parses as one
            (`3e-4`, `true`, `[1, 2]`, `"x"`), else as a plain string (`runs/a`).

    Raises:
        ConfigError: listing every unknown key and bad value, one line each.
    """
    data: dict[str, Any] = {}
    where_in_file: Callable[[KeyPath], str] = lambda _: ""  # noqa: E731
    if path is not None:
        data, where_in_file = _read_file(Path(path))
    problems = _check_keys(schema, data, (), where_in_file)
    for problem in problems:
        _delete(data, problem.path)

    overridden: list[KeyPath] = []
    for item in overrides:
        key_path, raw = _split_override(item)
        target, problem = _resolve_key(schema, key_path)
        if problem is not None:
            problems.append(problem)
            continue
        value = _parse_override_value(raw, target)
        nested = _check_keys(target, value, key_path, lambda _: COMMAND_LINE)
        if nested:
            problems.extend(nested)
            continue
        clash = _non_table_above(data, key_path)
        if clash is not None:  # `train: 5` in the file and `train.steps=...` given
            at = where_in_file(clash)
            problems.append(
                _Problem(
                    clash,
                    f"{_dotted(clash)}{f' ({at})' if at else ''} is a value, not a section: "
                    f"it cannot take {_dotted(key_path)} from the command line",
                )
            )
            continue
        _deep_set(data, key_path, value)
        overridden.append(key_path)

    def where(key_path: KeyPath) -> str:
        if any(key_path[: len(o)] == o for o in overridden):
            return COMMAND_LINE
        return where_in_file(key_path) if _contains(data, key_path) else ""

    lines = [p.message for p in problems]
    try:
        cfg = schema.model_validate(data)
    except pydantic.ValidationError as err:
        lines.extend(_value_errors(schema, err, where))
        cfg = None
    if lines:
        raise ConfigError("\n".join(lines))
    return cfg


def dump_config(cfg: Section, fmt: Literal["toml", "yaml", "json"] = "toml") -> str:
    """Print a resolved config as TOML, YAML or JSON text; TOML lists keys whose value is None
    as comments (`# key = (unset)`), as it has no null.

    TOML and YAML output load back (with `load_config`) to an equal config.
    """
    if fmt == "json":
        return json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n"
    plain = _plain(cfg.model_dump(mode="python"))
    if fmt == "yaml":
        return yaml.safe_dump(plain, sort_keys=False, allow_unicode=True)
    if fmt == "toml":
        return _mark_unset(tomli_w.dumps(drop_none(plain)), _unset_keys(plain))
    raise ValueError(f"unknown config format {fmt!r}; expected toml, yaml or json")


def _unset_keys(value: dict, prefix: str = "") -> dict[str, list[str]]:
    """table (dotted, "" for the top) -> its keys whose value is None."""
    found: dict[str, list[str]] = {}
    for key, item in value.items():
        if item is None:
            found.setdefault(prefix, []).append(key)
        elif isinstance(item, dict):
            for table, keys in _unset_keys(item, f"{prefix}.{key}" if prefix else key).items():
                found.setdefault(table, []).extend(keys)
    return found


def _mark_unset(text: str, unset: dict[str, list[str]]) -> str:
    """TOML has no null: list each unset key as a comment at the end of its table, so that the
    output shows every key and still loads back to the same config."""
    lines, out, table = text.splitlines(), [], ""

    def close(name: str) -> None:
        out.extend(f"# {key} = (unset)" for key in unset.pop(name, []))

    for line in lines:
        if line.startswith("[") and line.endswith("]"):
            while out and not out[-1]:
                out.pop()
            close(table)
            out.append("")
            table = line.strip("[]")
        out.append(line)
    close(table)
    for name, keys in unset.items():  # tables with nothing set at all
        out += ["", f"[{name}]", *(f"# {key} = (unset)" for key in keys)]
    return "\n".join(out).lstrip("\n") + "\n"


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The data of a TOML or YAML file (errors name the file and line), not yet validated."""
    return _read_file(Path(path))[0]


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`key.sub=value` items set into raw config data that is validated afterwards (a pipeline
    file): each value is read as TOML when it parses as one, else as text."""
    for item in overrides:
        key_path, raw = _split_override(item)
        clash = _non_table_above(data, key_path)
        if clash is not None:
            raise ConfigError(
                f"{_dotted(clash)} is a value, not a section: it cannot take "
                f"{_dotted(key_path)} from the command line"
            )
        _deep_set(data, key_path, _parse_override_value(raw, Any))
    return data


def config_hash(cfg: Section) -> str:
    """sha256 (hex) of the config's canonical JSON: sorted keys, no whitespace."""
    text = json.dumps(cfg.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------- reading files


def _read_file(path: Path) -> tuple[dict[str, Any], Callable[[KeyPath], str]]:
    """Parse a config file; returns its data and a function giving `file:line` of a key."""
    suffix = path.suffix.lower()
    if suffix not in CONFIG_EXTENSIONS:
        raise ConfigError(
            f"{path}: unsupported config file type {path.suffix or '(none)'!r}; "
            f"use one of {', '.join(CONFIG_EXTENSIONS)}"
        )
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if not path.is_file():
        raise ConfigError(f"config path is not a file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if suffix == ".toml":
        data, lines = _parse_toml(path, text)
    else:
        data, lines = _parse_yaml(path, text)

    def where(key_path: KeyPath) -> str:
        # The line of the key itself, else of the nearest enclosing key (inline tables).
        for end in range(len(key_path), 0, -1):
            if key_path[:end] in lines:
                return f"{path}:{lines[key_path[:end]]}"
        return str(path)

    return data, where


_TOML_POSITION = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")


def _parse_toml(path: Path, text: str) -> tuple[dict[str, Any], dict[KeyPath, int]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        message = str(err)
        match = _TOML_POSITION.search(message)
        if match:
            message = message[: match.start()]
            raise ConfigError(f"{path}:{match[1]}:{match[2]}: invalid TOML: {message}") from None
        raise ConfigError(f"{path}: invalid TOML: {message}") from None
    return data, _toml_key_lines(text)


def _parse_yaml(path: Path, text: str) -> tuple[dict[str, Any], dict[KeyPath, int]]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        if mark is not None:
            raise ConfigError(
                f"{path}:{mark.line + 1}:{mark.column + 1}: invalid YAML: {problem}"
            ) from None
        raise ConfigError(f"{path}: invalid YAML: {problem}") from None
    finally:
        loader.dispose()
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a config file must be a mapping of keys to values, "
            f"not a {type(data).__name__}"
        )
    lines: dict[KeyPath, int] = {}
    _yaml_key_lines(node, (), lines)
    return data, lines


def _yaml_key_lines(node: yaml.Node, prefix: KeyPath, out: dict[KeyPath, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key_path = (*prefix, key_node.value)
            out.setdefault(key_path, key_node.start_mark.line + 1)
            _yaml_key_lines(value_node, key_path, out)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            out.setdefault((*prefix, index), item.start_mark.line + 1)
            _yaml_key_lines(item, (*prefix, index), out)


_KEY_PART = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
_DOTTED_KEY = rf"{_KEY_PART}(?:\s*\.\s*{_KEY_PART})*"
_TABLE_RE = re.compile(rf"^\s*(\[\[?)\s*({_DOTTED_KEY})\s*\]")
_KEY_VALUE_RE = re.compile(rf"^\s*({_DOTTED_KEY})\s*=")
_KEY_PART_RE = re.compile(_KEY_PART)


def _toml_key_lines(text: str) -> dict[KeyPath, int]:
    """Map each key path of a (valid) TOML document to the line that sets it, by scanning.

    Good enough for messages: it follows `[table]`, `[[array.of.tables]]` and dotted keys, and
    skips multi-line strings; keys inside inline tables map to their enclosing key's line.
    """
    lines: dict[KeyPath, int] = {}
    table: KeyPath = ()
    array_counts: dict[tuple[str, ...], int] = {}
    in_string = None  # the delimiter of the multi-line string we are inside, if any
    for number, line in enumerate(text.splitlines(), start=1):
        if in_string is not None:
            if line.count(in_string) % 2 == 1:
                in_string = None
            continue
        if match := _TABLE_RE.match(line):
            parts = _split_toml_key(match[2])
            if match[1] == "[[":
                array_counts[parts] = array_counts.get(parts, 0) + 1
                for nested in [k for k in array_counts if k[: len(parts)] == parts != k]:
                    del array_counts[nested]  # a new element starts its own nested arrays
            table = _with_array_indexes(parts, array_counts)
            lines.setdefault(table, number)
        elif match := _KEY_VALUE_RE.match(line):
            lines.setdefault((*table, *_split_toml_key(match[1])), number)
        for delimiter in ('"""', "'''"):
            if line.count(delimiter) % 2 == 1:
                in_string = delimiter
    return lines


def _split_toml_key(text: str) -> tuple[str, ...]:
    parts = []
    for match in _KEY_PART_RE.finditer(text):
        part = match[0]
        if part.startswith('"'):
            part = tomllib.loads(f"k = {part}")["k"]
        elif part.startswith("'"):
            part = part[1:-1]
        parts.append(part)
    return tuple(parts)


def _with_array_indexes(parts: tuple[str, ...], array_counts: dict) -> KeyPath:
    """`[a.b]` after `[[a]]` means a[last].b: insert the array-of-tables indexes."""
    out: list[str | int] = []
    for end in range(1, len(parts) + 1):
        out.append(parts[end - 1])
        if parts[:end] in array_counts and end < len(parts):
            out.append(array_counts[parts[:end]] - 1)
    if parts in array_counts:
        out.append(array_counts[parts] - 1)
    return tuple(out)


# ----------------------------------------------------------------------------- keys and types


class _Problem(typing.NamedTuple):
    path: KeyPath
    message: str


def _strip(annotation: Any) -> Any:
    """Drop `Annotated[...]` and `| None` so the interesting type is left."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _strip(members[0])
    return annotation


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)


def _is_mapping(annotation: Any) -> bool:
    origin = get_origin(annotation)
    return isinstance(origin, type) and issubclass(origin, Mapping)


def _is_sequence(annotation: Any) -> bool:
    origin = get_origin(annotation)
    return origin in (list, tuple, set, frozenset) or origin is Sequence


def _child(annotation: Any, key: str | int) -> tuple[bool, Any]:
    """The annotation one step down from `annotation` by `key`: (known, annotation)."""
    annotation = _strip(annotation)
    if _is_section(annotation):
        field = annotation.model_fields.get(key) if isinstance(key, str) else None
        return (field is not None, field.annotation if field else None)
    args = get_args(annotation)
    if _is_mapping(annotation):
        return True, args[1] if len(args) == 2 else Any
    if _is_sequence(annotation) and isinstance(key, int):
        if get_origin(annotation) is tuple and args and args[-1] is not Ellipsis:
            return key < len(args), args[key] if key < len(args) else None
        return True, args[0] if args else Any
    return False, None


def _dotted(key_path: KeyPath) -> str:
    text = ""
    for part in key_path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _unknown_key(schema: Any, key_path: KeyPath, source: str) -> _Problem:
    """The message for a key that `schema` (the annotation at key_path[:-1]) does not have."""
    parent = _dotted(key_path[:-1])
    key = str(key_path[-1])
    at = f" ({source})" if source else ""
    schema = _strip(schema)
    if not _is_section(schema):
        return _Problem(
            key_path,
            f"unknown config key {_dotted(key_path)!r}{at}: {parent!r} is a value, "
            "not a section, so it has no keys",
        )
    allowed = sorted(schema.model_fields)
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    level = f"under {parent!r}" if parent else "at the top level"
    return _Problem(
        key_path,
        f"unknown config key {_dotted(key_path)!r}{at}: {hint}"
        f"allowed keys {level}: {', '.join(allowed) or '(none)'}",
    )


def _check_keys(
    annotation: Any, value: Any, prefix: KeyPath, where: Callable[[KeyPath], str]
) -> list[_Problem]:
    """Every key in `value` that the schema does not have, with a message each."""
    problems: list[_Problem] = []
    annotation = _strip(annotation)
    if isinstance(value, dict) and (_is_section(annotation) or _is_mapping(annotation)):
        for key, item in value.items():
            known, child = _child(annotation, key)
            if known:
                problems.extend(_check_keys(child, item, (*prefix, key), where))
            else:
                problems.append(_unknown_key(annotation, (*prefix, key), where((*prefix, key))))
    elif isinstance(value, list) and _is_sequence(annotation):
        for index, item in enumerate(value):
            known, child = _child(annotation, index)
            if known:
                problems.extend(_check_keys(child, item, (*prefix, index), where))
    return problems


def _resolve_key(schema: type[Section], key_path: KeyPath) -> tuple[Any, _Problem | None]:
    """The annotation an override's key path points at, or the problem with the path."""
    annotation: Any = schema
    for depth, key in enumerate(key_path):
        known, child = _child(annotation, key)
        if not known:
            return None, _unknown_key(annotation, key_path[: depth + 1], COMMAND_LINE)
        annotation = child
    return annotation, None


# ----------------------------------------------------------------------------- overrides


def _split_override(item: str) -> tuple[KeyPath, str]:
    key, sep, raw = item.partition("=")
    parts = tuple(part.strip() for part in key.split("."))
    if not sep or not all(parts):
        raise ConfigError(
            f"bad config override {item!r} (command line): expected key=value "
            "or section.key=value, e.g. model.dtype=bfloat16"
        )
    return parts, raw


def _wants_string(annotation: Any) -> bool:
    """Whether a field takes only text, so `source=1.0` should stay the string '1.0'."""
    annotation = _strip(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        return all(_wants_string(a) for a in members)
    if get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in get_args(annotation))
    return isinstance(annotation, type) and issubclass(annotation, str | PurePath)


def _parse_override_value(raw: str, annotation: Any) -> Any:
    """A TOML value when `raw` parses as one (and the field is not text-only), else `raw`."""
    try:
        parsed = tomllib.loads(f"value = {raw}")
    except tomllib.TOMLDecodeError:
        return raw
    if set(parsed) != {"value"}:  # `raw` smuggled in more keys, e.g. "1\nx = 2"
        return raw
    value = parsed["value"]
    if _wants_string(annotation) and not isinstance(value, str):
        return raw.strip()
    return value


def _contains(data: Any, key_path: KeyPath) -> bool:
    for key in key_path:
        in_dict = isinstance(data, dict) and key in data
        in_list = isinstance(data, list) and isinstance(key, int) and 0 <= key < len(data)
        if not (in_dict or in_list):
            return False
        data = data[key]
    return True


def _non_table_above(data: dict[str, Any], key_path: KeyPath) -> KeyPath | None:
    """The first prefix of `key_path` that `data` holds as a value rather than a table."""
    for depth in range(1, len(key_path)):
        if not isinstance(data, dict) or key_path[depth - 1] not in data:
            return None
        data = data[key_path[depth - 1]]
        if not isinstance(data, dict):
            return key_path[:depth]
    return None


def _deep_set(data: dict[str, Any], key_path: KeyPath, value: Any) -> None:
    for key in key_path[:-1]:
        if not isinstance(data.get(key), dict):
            data[key] = {}  # the override replaces whatever non-table the file had here
        data = data[key]
    data[key_path[-1]] = value


def _delete(data: Any, key_path: KeyPath) -> None:
    for key in key_path[:-1]:
        data = data[key]
    del data[key_path[-1]]


# ----------------------------------------------------------------------------- value errors


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _walk_loc(schema: type[Section], loc: tuple) -> tuple[KeyPath, Any, tuple]:
    """Split pydantic's error location into (key path, its annotation, leftover tags)."""
    annotation: Any = schema
    for depth, key in enumerate(loc):
        known, child = _child(annotation, key)
        if not known:
            return tuple(loc[:depth]), annotation, tuple(loc[depth:])
        annotation = child
    return tuple(loc), annotation, ()


def _describe_type(annotation: Any) -> str:
    annotation = _strip(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        return " or ".join(_describe_type(a) for a in get_args(annotation))
    names = {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "text"}
    if annotation in names:
        return names[annotation]
    if annotation is type(None):
        return "none"
    return getattr(annotation, "__name__", str(annotation))


def _what_is_allowed(error: Mapping[str, Any], annotation: Any, tags: tuple) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<"}
    bounds["less_than_equal"] = "<="
    if kind in bounds:
        op = bounds[kind]
        limit = ctx.get({">": "gt", ">=": "ge", "<": "lt", "<=": "le"}[op])
        if isinstance(limit, float) and limit.is_integer():
            limit = int(limit)  # pydantic hands float fields' bounds back as floats: "> 0.0"
        return f"must be {op} {limit}"
    if kind == "literal_error":
        literal = _strip(annotation)
        if get_origin(literal) is Literal:
            return "must be one of " + ", ".join(_show(v) for v in get_args(literal))
    if kind == "missing":
        return "is required"
    if kind in ("model_type", "model_attributes_type", "dict_type") and _is_section(
        _strip(annotation)
    ):
        keys = ", ".join(sorted(_strip(annotation).model_fields))
        return f"is a section, not a value; set its keys instead ({keys})"
    if tags and get_origin(_strip(annotation)) in (Union, types.UnionType):
        return f"must be {_describe_type(annotation)}"
    message = error["msg"]
    message = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if message.startswith("Input should be "):
        message = "must be " + message.removeprefix("Input should be ")
    return message


def _value_errors(
    schema: type[Section], err: pydantic.ValidationError, where: Callable[[KeyPath], str]
) -> list[str]:
    """One line per bad value: `key = value (source): what is allowed`."""
    lines: list[str] = []
    seen: set[KeyPath] = set()
    for error in err.errors():
        key_path, annotation, tags = _walk_loc(schema, tuple(error["loc"]))
        if error["type"] == "extra_forbidden" and tags:  # missed by _check_keys (unions)
            key_path = (*key_path, tags[0])
            source = where(key_path)
            lines.append(_unknown_key(annotation, key_path, source).message)
            continue
        if key_path in seen:  # a union reports once per member; one line is enough
            continue
        seen.add(key_path)
        source = where(key_path)
        text = _dotted(key_path) or "config"
        value = error.get("input")
        if error["type"] != "missing" and not isinstance(value, dict | pydantic.BaseModel):
            text += f" = {_show(value)}"
        if source:
            text += f" ({source})"
        lines.append(f"{text}: {_what_is_allowed(error, annotation, tags)}")
    return lines


# ----------------------------------------------------------------------------- dumping


def _plain(value: Any) -> Any:
    """Python-mode dump → only dicts, lists and TOML/YAML scalars."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted(_plain(v) for v in value)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    return value


def drop_none(value: Any) -> Any:
    """Without None values (TOML has no null), in nested dicts and lists too."""
    if isinstance(value, dict):
        return {k: drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_none(v) for v in value]
    return value


__all__ = [
    "CONFIG_EXTENSIONS",
    "ModelSection",
    "Section",
    "config_hash",
    "drop_none",
    "dump_config",
    "load_config",
]
