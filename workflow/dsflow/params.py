"""Load, overlay and validate params.yaml against the one JSON Schema.

Snakemake validates its config with the same schema (workflow/rules/common.smk); when Snakemake
runs a stage it hands over its effective config (params.yaml + any --configfile overlays) in
DSFLOW_CONFIG, so a stage sees exactly what Snakemake validated. Run by hand or by DVC, a stage
reads params.yaml, plus the overlays named in DSFLOW_PROFILES.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from dsflow.errors import UsageError

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "params.schema.yaml"
CONFIG_ENV = "DSFLOW_CONFIG"
PROFILES_ENV = "DSFLOW_PROFILES"


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


def _format_error(err: jsonschema.ValidationError, source: str) -> str:
    key = ".".join(str(p) for p in err.absolute_path) or "(top level)"
    if err.validator == "additionalProperties":
        allowed = sorted(err.schema.get("properties", {}))
        unknown = sorted(set(err.instance) - set(allowed), key=str)
        where = f"{key}." if err.absolute_path else ""
        return (
            f"{source}: unknown key {where}{unknown[0]} (allowed under {key}: {', '.join(allowed)})"
        )
    if err.validator == "required":
        return f"{source}: {key}: missing required key ({err.message})"
    value = json.dumps(err.instance, default=str)
    return f"{source}: {key}: {value} is not allowed (allowed: {_describe_allowed(err.schema)})"


def validate(params: dict, source: str = "params.yaml") -> dict:
    """Validate against the schema; return a copy with schema defaults filled in."""
    schema = load_schema()
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(
        validator.iter_errors(params), key=lambda e: ([str(p) for p in e.absolute_path], e.message)
    )
    if errors:
        # Deepest first: an error inside a section says more than "section is invalid".
        err = max(errors, key=lambda e: len(e.absolute_path))
        raise UsageError(one_line(_format_error(err, source)))
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
        return validate(config, source="Snakemake config")
    params = read_yaml(path)
    if overlays is None:
        overlays = [p for p in os.environ.get(PROFILES_ENV, "").split(os.pathsep) if p]
    sources = [str(path)]
    for overlay in overlays:
        params = deep_merge(params, read_yaml(overlay))
        sources.append(str(overlay))
    return validate(params, source=" + ".join(sources))


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
