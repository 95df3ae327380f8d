"""The docs site's REST API reference, written from the app's own OpenAPI document.

``python -m dfp_dev.api_reference docs/api-reference.md`` writes the page; a test checks that the committed page
is what the current app's document gives, so the reference never drifts from the API.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

METHODS = ("get", "post", "put", "patch", "delete")
BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "minLength", "maxLength", "minItems",
          "maxItems", "pattern", "maxProperties")


def openapi_document() -> dict:
    from dfp_api.app import create_app
    from dfp_api.settings import ApiSettings

    return create_app(ApiSettings(redis_url="redis://127.0.0.1:1/0", auth_disabled=True)).openapi()


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _type(schema: dict) -> str:
    """A schema's type in a few words: a reference links its schema's section."""
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[{name}](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(dict.fromkeys(_type(s) for s in schema[key]))
    if "enum" in schema:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"map of {_type(schema['additionalProperties'])}"
    return kind


def _bounds(schema: dict) -> str:
    found = [f"{key} {json.dumps(schema[key])}" for key in BOUNDS if key in schema]
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key, []):
            found += [f"{k} {json.dumps(sub[k])}" for k in BOUNDS if k in sub]
    return ", ".join(dict.fromkeys(found))


def _operation(path: str, method: str, op: dict) -> list[str]:
    lines = [f"### `{method.upper()} {path}`", "", _cell(op.get("description") or op.get("summary", "")), ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | required | bounds | description |", "|---|---|---|---|---|---|"]
        for p in params:
            schema = p.get("schema", {})
            lines.append(f"| `{p['name']}` | {p['in']} | {_type(schema)} | {'yes' if p.get('required') else 'no'} "
                         f"| {_cell(_bounds(schema))} | {_cell(p.get('description', ''))} |")
        lines.append("")
    body = op.get("requestBody", {}).get("content", {})
    for media, content in body.items():
        lines += [f"Request body ({media}): {_type(content.get('schema', {}))}", ""]
    lines += ["| status | description | body |", "|---|---|---|"]
    for status, reply in op.get("responses", {}).items():
        shapes = [_type(c.get("schema", {})) for c in reply.get("content", {}).values()]
        lines.append(f"| {status} | {_cell(reply.get('description', ''))} | {', '.join(shapes)} |")
    return lines + [""]


def _schema(name: str, schema: dict) -> list[str]:
    lines = [f"### {name}", ""]
    if schema.get("description"):
        lines += [_cell(schema["description"]), ""]
    props = schema.get("properties", {})
    if not props:
        return lines + [f"Type: {_type(schema)}", ""]
    required = set(schema.get("required", []))
    lines += ["| field | type | required | default | bounds | description |", "|---|---|---|---|---|---|"]
    for field, sub in props.items():
        default = f"`{_cell(json.dumps(sub['default']))}`" if "default" in sub else ""
        lines.append(f"| `{field}` | {_type(sub)} | {'yes' if field in required else 'no'} | {default} "
                     f"| {_cell(_bounds(sub))} | {_cell(sub.get('description', ''))} |")
    return lines + [""]


def api_reference(document: dict | None = None) -> str:
    """The reference page: every operation (parameters, body, replies), then every schema (fields, bounds)."""
    doc = document or openapi_document()
    info = doc.get("info", {})
    lines = ["# REST API reference", "",
             f"{info.get('title', '')} {info.get('version', '')}: {_cell(info.get('summary', ''))}", "",
             "Written from the app's own OpenAPI document (`python -m dfp_dev.api_reference docs/api-reference.md`);"
             " a running API serves the same document at `/openapi.json`. Every request but the probes and "
             "`/metrics` takes `Authorization: Bearer <key>` (see [the security model](security.md)).", "",
             "## Operations", ""]
    for path, item in doc["paths"].items():
        for method in METHODS:
            if method in item:
                lines += _operation(path, method, item[method])
    lines += ["## Schemas", ""]
    for name, schema in doc.get("components", {}).get("schemas", {}).items():
        lines += _schema(name, schema)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = api_reference()
    if argv:
        Path(argv[0]).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
