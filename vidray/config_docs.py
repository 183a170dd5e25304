"""Writes `docs/configuration.md`, the job-config reference, from the config classes in `vidray.config`: every
key with its dotted name, type, default, resume rule and the docstring under its field.

    python -m vidray.config_docs > docs/configuration.md

`tests/unit/test_docs.py` regenerates it and fails when the committed file differs, naming this command.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import tempfile
import textwrap
import types
import typing
from typing import Any, Iterator

import yaml

from vidray import config
from vidray.config.bounds import bounded_type_text

COMMAND = "python -m vidray.config_docs > docs/configuration.md"


@dataclasses.dataclass(frozen=True)
class Key:
    """One documented config key."""

    name: str  # dotted: "data.fps"
    type: str  # the annotation as written in the section's module under vidray/config/ (a bounded number: its range)
    default: str  # as YAML writes it
    doc: str  # the field's docstring, one paragraph
    rule: str  # "fixed" | "changeable" (vidray.config.RESUME_RULES)
    section: type | None  # the config class of a section key, else None


def field_docstrings(cls: type) -> dict[str, tuple[str, str]]:
    """{field name: (annotation source, docstring)} of `cls` and its bases, read from the class source: a field's
    docstring is the string literal right after it (PEP 257's attribute docstring); "" when it has none."""
    out: dict[str, tuple[str, str]] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):  # a section and its bases
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, after in zip(body, [*body[1:], None]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                doc = ""
                if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                        and isinstance(after.value.value, str)):
                    doc = " ".join(inspect.cleandoc(after.value.value).split())
                out[node.target.id] = (ast.unparse(node.annotation), doc)
    return out


def _plain(value: Any) -> Any:
    """A default as YAML would hold it: tuples (and Bucket) as lists, config sections as dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _show_default(value: Any) -> str:
    """The default in YAML flow style, with the machine's temp folder written `<tmp>` (the file must not depend on
    the machine that generated it)."""
    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=10**6).strip()
    text = text.removesuffix("\n...").removesuffix("...").strip()
    return text.replace(tempfile.gettempdir(), "<tmp>")


def _section_class(hint: Any) -> type | None:
    """The config class of a section (or of an optional section: `LoraConfig | None`), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), None)
    return None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def iter_keys(cls: type = config.JobConfig, prefix: str = "", rule: str = "") -> Iterator[Key]:
    """Every key of `cls`, depth first in field order; a section's own key comes before its keys."""
    hints = typing.get_type_hints(cls)
    bounded = typing.get_type_hints(cls, include_extras=True)
    docs = field_docstrings(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        annotation, doc = docs[f.name]
        annotation = bounded_type_text(bounded[f.name]) or annotation  # `int >= 1`, not `AtLeastOne`
        section = _section_class(hints[f.name])
        key_rule = config.RESUME_RULES.get(name, rule)
        default = _default(f)
        shown = "{...}" if section is not None and default is not None else _show_default(default)
        yield Key(name, annotation, shown, doc, key_rule, section)
        if section is not None:
            yield from iter_keys(section, f"{name}.", key_rule)


def _class_doc(cls: type) -> str:
    """A config class's own docstring as one paragraph; "" for none (dataclasses make up `Name(fields...)`)."""
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(f"{cls.__name__}("):
        return ""
    return " ".join(inspect.cleandoc(doc).split())


def render() -> str:
    """The whole of `docs/configuration.md`."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the config classes in `vidray/config/` (each key's text is the docstring under its field)",
        f"by `{COMMAND}`; do not edit by hand:",
        "`tests/unit/test_docs.py` fails when this file is out of date.",
        "How configs are written, loaded and overridden: [training.md](training.md#job-configs).",
        "",
        "Each key: its dotted name (the name for a `section.key=value` override), type, default, and whether a",
        "resumed run may change it (**fixed** keys must equal the checkpoint's; see",
        "[training.md](training.md#resume-rules)).",
    ]
    for key in iter_keys():
        if key.section is not None and "." not in key.name:  # a top-level section: its own heading
            lines += ["", f"## `{key.name}`", ""]
            lines += [text + "\n" for text in (key.doc, _class_doc(key.section)) if text]
            continue
        if "." not in key.name and not any(line == "## Top level" for line in lines):
            lines += ["", "## Top level", ""]
        if key.section is not None:  # a nested section (`train.ema`, `placement.vae`): its keys follow
            extra = f" {_class_doc(key.section)}" if _class_doc(key.section) else ""
            how = f"default `{key.default}`, {key.rule}" if key.rule else "a section"
            lines.append(f"- **`{key.name}`** `{key.type}`, {how}: {key.doc}{extra}")
            continue
        doc = f": {key.doc}" if key.doc else ""
        lines.append(f"- **`{key.name}`** `{key.type}`, default `{key.default}`, {key.rule}{doc}")
    return "\n".join(lines) + "\n"


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
