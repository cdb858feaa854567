"""Walking a config section against its key table (keys.py): aliases and deprecated spellings read as the key they
stand for, inert keys noted, values checked for type, finiteness and range (the error names the key path and the
accepted range), "auto" that nothing in zkern resolves given DeepSpeed's default (noted), unknown keys a warning at the
top level and an error inside a section whose DeepSpeed model forbids them, a near-miss of a known key always an
error that says "did you mean". parse.py walks each section of a file with it.

    python -m pytest tests/config/test_config.py -q
"""

from __future__ import annotations

import difflib
import json
import math
from typing import Any

from zkern.config import keys
from zkern.config.keys import AUTO, Alias, DefaultOnly, Inert, Key, SectionOff
from zkern.config.sections import ConfigNotes
from zkern.errors import ConfigError

_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16",
           "bf16": "bf16", "bfloat16": "bf16"}
NEAR_MISS = 0.85  # difflib ratio at or above which an unknown key is taken for a typo of a known one


class Notes:
    def __init__(self):
        self.inert: list[tuple[str, str]] = []
        self.warned: list[tuple[str, str]] = []
        self.renamed: list[tuple[str, str]] = []
        self.filled: list[tuple[str, str]] = []

    def frozen(self) -> ConfigNotes:
        return ConfigNotes(tuple(self.inert), tuple(self.warned), tuple(self.renamed), tuple(self.filled))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _near_miss(key: str, known: list[str], prefixes: bool = False) -> str | None:
    """The known key `key` is a typo of, if any: a close spelling, or (inside a section) a key it begins or ends
    ("grad_accum" for "grad_accum_dtype")."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=NEAR_MISS)
    if close:
        return close[0]
    if prefixes and len(key) >= 4:
        return next((k for k in known if k.startswith(key) or key.startswith(k)), None)
    return None


def did_you_mean(key: str, known: list[str], path: str) -> str:
    """A 'did you mean' naming the nearest key here, else anywhere in the config, else the keys of this section."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{_join(path, close[0])}'?"
    leaves = {p.rsplit(".", 1)[-1]: p for p in keys.all_known_paths()}
    close = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.75)
    if close and leaves[close[0]] != _join(path, key):  # never the refused key itself (another type's key there)
        return f"; did you mean '{leaves[close[0]]}'?"
    return f"; known keys here: {', '.join(sorted(known))}"


def _range_text(spec: Key) -> str:
    lo = None if spec.lo == -math.inf else spec.lo
    hi = None if spec.hi == math.inf else spec.hi
    if lo is not None and hi is not None:
        return f"from {lo:g} to {hi:g}"
    if lo is not None:
        return f">= {lo:g}"
    return f"<= {hi:g}" if hi is not None else "any finite number"


def check_value(path: str, spec: Key, value: Any) -> Any:
    """One value of one key: its type, finiteness and range; a ConfigError naming the key and what it accepts."""
    kind = spec.kind
    if kind.endswith("_or_null") and value is None:
        return None
    base = kind.removesuffix("_or_null")
    if base == "elements":  # a count of elements: an int
        base = "int"
    if base in ("int", "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"'{path}' must be a number ({_range_text(spec)}), got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"'{path}' must be a finite number ({_range_text(spec)}), got {value!r}")
        if base == "int":
            if int(value) != value:
                raise ConfigError(f"'{path}' must be a whole number ({_range_text(spec)}), got {value!r}")
            value = int(value)
        else:
            value = float(value)
        if not spec.lo <= value <= spec.hi:
            raise ConfigError(f"'{path}' must be {_range_text(spec)}, got {value!r}")
        return value
    if base == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"'{path}' must be true or false, got {value!r}")
        return value
    if base == "str":
        if not isinstance(value, str):
            raise ConfigError(f"'{path}' must be a string, got {value!r}")
        return value
    if base == "str_list":
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"'{path}' must be a list of names like [\"Block\"], got {value!r}")
        return tuple(value)
    if base == "betas":
        if (not isinstance(value, (list, tuple)) or len(value) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b)
                           and 0.0 <= b < 1.0 for b in value)):
            raise ConfigError(f"'{path}' must be a list of two numbers in [0, 1) like [0.9, 0.999], got {value!r}")
        return (float(value[0]), float(value[1]))
    if base == "dtype":
        dtype = _DTYPES.get(value) if isinstance(value, str) else None
        if dtype is None:
            raise ConfigError(f"'{path}' must be \"fp32\", \"fp16\" or \"bf16\" (or null), got {value!r}")
        return dtype
    if base == "json":
        return value
    if base == "section":
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"'{path}' must be a JSON object, got {value!r}")
        return value
    raise AssertionError(kind)


def _asks_nothing(value: Any) -> bool:
    """A section DeepSpeed lists that zkern lacks asks for nothing: absent, empty, or every switch off."""
    if value is None or value is False:
        return True
    if not isinstance(value, dict):
        return False
    if "enabled" in value:
        return value["enabled"] in (False, None, AUTO)
    if "device" in value:
        return value["device"] in (None, "none")
    if "autotp_size" in value:
        return isinstance(value["autotp_size"], (int, float)) and value["autotp_size"] <= 1
    return all(v in (False, None, 0, {}, [], "none") or (isinstance(v, dict) and _asks_nothing(v))
               for v in value.values())


def section(path: str, raw: Any, table: dict, notes: Notes, *, strict: bool | None = None) -> dict:
    """{canonical key: checked value} for the implemented keys of one section present in raw."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"'{path}' must be a JSON object, got {raw!r}")
    strict = path in keys.STRICT if strict is None else strict
    known = [k for k, spec in table.items()]
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # canonical -> the spelling that set it
    for key, value in raw.items():
        where = _join(path, key)
        spec = table.get(key)
        if isinstance(spec, Alias):
            canonical = spec.canonical
            notes.renamed.append((where, _join(path, canonical)))
            spec = table[canonical]
        else:
            canonical = key
        if canonical in given:
            raise ConfigError(f"'{where}' and '{_join(path, given[canonical])}' set the same key (DeepSpeed's two "
                              f"spellings of it); keep one")
        given[canonical] = key
        if spec is None:
            unknown_key(path, key, value, known, notes, strict)
            continue
        if isinstance(spec, Inert):
            notes.inert.append((where, spec.why))
            continue
        if isinstance(spec, DefaultOnly):
            if value != spec.default and value != AUTO and not (value in ([], {}) and spec.default in (None, "auto")):
                raise ConfigError(f"'{where}' = {json.dumps(value)} asks for {spec.what or 'a feature'}, which zkern "
                                  f"does not implement; remove it or set it to DeepSpeed's default "
                                  f"({json.dumps(spec.default)})")
            continue
        if isinstance(spec, SectionOff):
            if not _asks_nothing(value):
                raise ConfigError(f"'{where}' asks for {spec.what}, which zkern does not implement; remove the "
                                  f"section or turn it off")
            if value not in (None, {}):
                notes.inert.append((where, "off"))
            continue
        if value == AUTO and spec.kind != "section":
            if spec.resolve_auto:
                out[canonical] = AUTO
                continue
            # DeepSpeed drops "auto" from its config models, so the key takes its default (the HF Trainer and
            # zkern.hf.Accelerator fill the keys they own before this)
            notes.filled.append((_join(path, canonical), f"{json.dumps(spec.default)} (DeepSpeed's default for "
                                                         f"\"auto\": nothing here fills it)"))
            if spec.default is not None:
                out[canonical] = spec.default
            continue
        if spec.kind == "elements" and isinstance(value, float) and math.isfinite(value) and int(value) != value:
            # a count of elements written as a fraction (Hugging Face's "auto" filled 0.9 x hidden^2 unrounded; older
            # DeepSpeed truncated it): taken rounded down, said in the start-up block
            notes.filled.append((where, f"{int(value)} ({value!r} rounded down: a count of elements)"))
            value = int(value)
        out[canonical] = check_value(where, spec, value)
    return out


def unknown_key(path: str, key: str, value: Any, known: list[str], notes: Notes, strict: bool) -> None:
    where = _join(path, key)
    typo = _near_miss(key, known, prefixes=bool(path))
    if typo is not None:
        raise ConfigError(f"unknown config key '{where}'; did you mean '{_join(path, typo)}'? (a typo would train "
                          f"with the default silently)")
    if not path:  # not DeepSpeed's at all: DeepSpeed ignores it, so zkern says so and goes on
        elsewhere = {p.rsplit(".", 1)[-1]: p for p in keys.all_known_paths() if "." in p}
        near = _near_miss(key, list(elsewhere))
        if near is not None:
            raise ConfigError(f"unknown config key '{where}'; did you mean '{elsewhere[near]}'? (it belongs in "
                              f"its section)")
        notes.warned.append((where, "not a DeepSpeed key: ignored (as DeepSpeed ignores it)"))
        return
    if strict:
        raise ConfigError(f"unknown config key '{where}'{did_you_mean(key, known, path)}")
    notes.warned.append((where, "not a key of this section: ignored (as DeepSpeed ignores it)"))
