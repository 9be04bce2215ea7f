"""Load, overlay and validate params.yaml against the one JSON Schema.

Snakemake validates its config with the same schema (workflow/rules/common.smk); when Snakemake
runs a stage it hands over its effective config (params.yaml + any --configfile overlays) in
DSFLOW_CONFIG, so a stage sees exactly what Snakemake validated. Run by hand or by DVC, a stage
reads params.yaml, plus the overlays named in DSFLOW_PROFILES.

Besides the schema, every value anywhere must be a finite number (no NaN, no +-Inf: a NaN
compares false with every bound) and an integer must fit 64 bits. YAML 1.1's number strings
(1e-3, which PyYAML and Snakemake read as text) are read as numbers where the schema wants one.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from dsflow.errors import UsageError

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "params.schema.yaml"
CONFIG_ENV = "DSFLOW_CONFIG"
# The files (and --config) Snakemake's config came from, to name them in a message.
CONFIG_SOURCE_ENV = "DSFLOW_CONFIG_SOURCE"
PROFILES_ENV = "DSFLOW_PROFILES"
# YAML 1.1 (PyYAML, Snakemake) reads 1e-3, 3E-4 and 1.5e3 as strings: it wants a dot and a
# signed exponent. Such a string is read as the number it spells where the schema wants one.
EXPONENT_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")
# Beyond this, an integer fits no C long: torch, numpy and DeepSpeed cannot take it.
INT64_MAX = 2**63 - 1
# How many allowed keys an unknown-key message lists before it points at the schema instead.
LISTED_KEYS = 8


def load_schema() -> dict:
    with open(SCHEMA_PATH) as f:
        return yaml.safe_load(f)


def read_yaml(path: str | Path) -> dict:
    """A YAML mapping from `path`; a missing, unreadable or non-mapping file is a UsageError."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise UsageError(f"{path}: file not found") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = one_line(getattr(e, "problem", None) or "invalid YAML")
        raise UsageError(f"{path}:{where}: {problem} (fix the YAML syntax)") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not valid UTF-8 at byte {e.start}; save it as UTF-8") from None
    except ValueError as e:  # a value YAML cannot construct, e.g. the date 2024-13-45
        raise UsageError(f"{path}: invalid value ({one_line(str(e))}); fix or quote it") from None
    except RecursionError:
        raise UsageError(f"{path}: nested too deeply to read") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.strerror or e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(
            f"{path}: expected a mapping of keys at the top, got {type(data).__name__}"
        )
    return data


def one_line(text: str) -> str:
    """`text` with line breaks and other control characters escaped: messages stay one line."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in str(text))


def deep_merge(base: dict, overlay: dict) -> dict:
    """`overlay` on top of `base`: mappings merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _describe_allowed(schema: dict) -> str:
    for word in ("oneOf", "anyOf"):
        if word in schema:
            return " or ".join(_describe_allowed(alt) for alt in schema[word])
    if "const" in schema:
        return json.dumps(schema["const"])
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v) for v in schema["enum"])
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds] if kinds else []
    text = " or ".join(str(k) for k in kinds)
    bounds = []
    for word, sym in (
        ("minimum", ">="),
        ("exclusiveMinimum", ">"),
        ("maximum", "<="),
        ("exclusiveMaximum", "<"),
    ):
        if word in schema:
            bounds.append(f"{sym} {schema[word]}")
    if "minItems" in schema or "maxItems" in schema:
        lo, hi = schema.get("minItems", 0), schema.get("maxItems", "any")
        bounds.append(f"of {lo} item(s)" if lo == hi else f"of {lo}..{hi} items")
    if "minLength" in schema:
        bounds.append(f"at least {schema['minLength']} character(s)")
    return " ".join(filter(None, [text, " and ".join(bounds)])) or "see the schema"


def _unknown_key(err: jsonschema.ValidationError, key: str, source: str) -> str:
    """One line for a key the schema does not know: the likeliest meant key, then the allowed
    ones (a short list; a long one is left to the schema)."""
    allowed = sorted(err.schema.get("properties", {}))
    unknown = sorted((str(k) for k in set(err.instance) - set(allowed)), key=str)[0]
    where = f"{key}." if err.absolute_path else ""
    meant = _did_you_mean(unknown, allowed, where)
    hint = f"; did you mean {meant}?" if meant else ""
    if len(allowed) <= LISTED_KEYS:
        listed = ", ".join(allowed)
    else:
        listed = f"{', '.join(allowed[:LISTED_KEYS])}, ... {len(allowed) - LISTED_KEYS} more"
        listed += " in workflow/schemas/params.schema.yaml"
    return f"{source}: unknown key {where}{unknown}{hint} (allowed under {key}: {listed})"


def _did_you_mean(unknown: str, allowed: list[str], where: str) -> str | None:
    """A key of that very name elsewhere (train.lr -> train.optimizer.lr), else a sibling key
    spelt like it (train.optimzer -> train.optimizer); dotted."""
    elsewhere = [k for k in flatten_schema(load_schema()) if k.split(".")[-1] == unknown]
    if elsewhere:
        return min(elsewhere, key=len)
    close = difflib.get_close_matches(unknown, allowed, n=1, cutoff=0.6)
    return where + close[0] if close else None


def flatten_schema(schema: dict, prefix: str = "") -> list[str]:
    """Every dotted key the schema declares, sections included."""
    out = []
    for key, sub in schema.get("properties", {}).items():
        out.append(prefix + key)
        out += flatten_schema(sub, f"{prefix}{key}.")
    return out


def _format_error(err: jsonschema.ValidationError, source: str) -> str:
    key = ".".join(str(p) for p in err.absolute_path) or "(top level)"
    if err.validator == "additionalProperties":
        return _unknown_key(err, key, source)
    if err.validator == "required":
        return f"{source}: {key}: missing required key ({err.message})"
    value = json.dumps(err.instance, default=str)
    return f"{source}: {key}: {value} is not allowed (allowed: {_describe_allowed(err.schema)})"


def _numeric_kind(schema: dict) -> str | None:
    """ "number" or "integer" when the schema (or one of its alternatives) takes one."""
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "number" in kinds:
        return "number"
    if "integer" in kinds:
        return "integer"
    for alt in schema.get("oneOf", []) + schema.get("anyOf", []):
        kind = _numeric_kind(alt)
        if kind:
            return kind
    return None


def coerce_numbers(value: Any, schema: dict) -> Any:
    """`value` with YAML 1.1's number strings (1e-3) read as numbers, and whole floats (1.0e6)
    as integers, where the schema wants a number or an integer."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return {k: coerce_numbers(v, props[k]) if k in props else v for k, v in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [coerce_numbers(v, schema["items"]) for v in value]
    kind = _numeric_kind(schema)
    if kind is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and EXPONENT_NUMBER.fullmatch(value.strip()):
        value = float(value)
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _leaves(node: Any, path: tuple = ()):
    """(path, value) of every scalar in nested mappings and lists."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _leaves(value, (*path, i))
    else:
        yield path, node


def check_finite(params: dict, source: str) -> None:
    """No setting anywhere (model.overrides included) is NaN or +-Inf: a NaN compares false
    with every bound, so the schema alone would let it through."""
    for path, value in _leaves(params):
        if isinstance(value, float) and not math.isfinite(value):
            key = ".".join(map(str, path))
            raise UsageError(
                one_line(f"{source}: {key}: {value} is not allowed (allowed: a finite number)")
            )


def check_int_range(params: dict, source: str) -> None:
    """Integers the schema leaves unbounded (model.overrides among them) still fit 64 bits."""
    for path, value in _leaves(params):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT64_MAX:
            key = ".".join(map(str, path))
            raise UsageError(
                one_line(
                    f"{source}: {key}: {value} is out of range (allowed: an integer of at most "
                    f"{INT64_MAX} in size)"
                )
            )


def validate(params: dict, source: str = "params.yaml") -> dict:
    """Validate against the schema; return a copy with schema defaults filled in."""
    schema = load_schema()
    params = coerce_numbers(params, schema)
    check_finite(params, source)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(
        validator.iter_errors(params), key=lambda e: ([str(p) for p in e.absolute_path], e.message)
    )
    if errors:
        # Deepest first: an error inside a section says more than "section is invalid".
        err = max(errors, key=lambda e: len(e.absolute_path))
        raise UsageError(one_line(_format_error(err, source)))
    check_int_range(params, source)
    params = fill_defaults(params, schema)
    check_model(params["model"], source)
    check_finetune(params, source)
    return params


def fp8_on(perf: dict) -> list[tuple[str, str]]:
    """The FP8 settings of `train.perf` that are on (false, or absent, is off), each as (key,
    its value as params.yaml writes it), `fp8` (the dense linears) first."""
    on = [(key, perf.get(key)) for key in ("fp8", "fp8_experts")]
    return [(key, "true" if value is True else str(value)) for key, value in on if value]


def check_finetune(params: dict, source: str) -> None:
    """LoRA adapts an existing model: it needs one to load and freeze."""
    train = params["train"]
    if train["finetune"] != "lora":
        return
    if not params["model"]["pretrained"]:
        raise UsageError(
            f"{source}: train.finetune: lora needs model.pretrained (the checkpoint whose weights "
            "stay frozen); set model.pretrained, or train.finetune: full to train every weight"
        )
    for key, value in fp8_on(train.get("perf") or {}):
        # torchao's float8 linear forms the weight gradient whether or not the weight trains
        # (under LoRA, a frozen base's wasted GEMM per linear); FP8 experts under LoRA's
        # adapted expert weights are untested.
        raise UsageError(
            f"{source}: train.perf.{key}: {value} is not supported with train.finetune: lora "
            f"(untested with LoRA's frozen base weights); set train.perf.{key}: false"
        )


def check_model(model: dict, source: str) -> None:
    """What the schema cannot say: a revision belongs to a model.pretrained."""
    if model.get("revision") is not None and not model.get("pretrained"):
        raise UsageError(
            one_line(
                f"{source}: model.revision: {model['revision']!r} names a revision but "
                "model.pretrained is null; set model.pretrained to a Hub id (org/name), or "
                "model.revision: null"
            )
        )


def fill_defaults(params: dict, schema: dict) -> dict:
    out = copy.deepcopy(params)
    for key, sub in schema.get("properties", {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if isinstance(out.get(key), dict) and sub.get("type") == "object":
            out[key] = fill_defaults(out[key], sub)
    return out


def load(path: str | Path = "params.yaml", overlays: list[str] | None = None) -> dict:
    """The validated effective params for a stage run."""
    if overlays is None and os.environ.get(CONFIG_ENV):
        try:
            config = json.loads(os.environ[CONFIG_ENV])
        except json.JSONDecodeError as e:
            raise UsageError(f"{CONFIG_ENV}: not valid JSON ({e.msg}); unset it") from None
        return validate(config, source=os.environ.get(CONFIG_SOURCE_ENV) or "Snakemake config")
    params = read_yaml(path)
    if overlays is None:
        overlays = [p for p in os.environ.get(PROFILES_ENV, "").split(os.pathsep) if p]
    sources = [str(path)]
    for overlay in overlays:
        params = deep_merge(params, read_yaml(overlay))
        sources.append(str(overlay))
    return validate(params, source=" + ".join(sources))


def digest(value: Any) -> str:
    """A short, stable stand-in for a params value (a whole section): its JSON's sha256."""
    blob = json.dumps(value, sort_keys=True).encode()
    return f"sha256:{hashlib.sha256(blob).hexdigest()[:16]}"


def get(params: dict, dotted: str) -> Any:
    """params['a']['b'] for 'a.b'."""
    node: Any = params
    for part in dotted.split("."):
        node = node[part]
    return node


def flatten(params: dict, prefix: str = "") -> dict[str, Any]:
    """{'a.b': value} for every leaf; lists are leaves."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out
