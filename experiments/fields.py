"""Every field an experiment config sets, read from the dataclasses themselves: name, type, default,
allowed values and one line of meaning (the field's comment, or its entry in the class docstring).

    python -m experiments.fields                      # all of them
    python -m experiments.fields model.overrides.rope # one group (any prefix of the keys)
    python -m experiments.fields --markdown > docs/CONFIG.md

TrainConfig's fields are top-level keys (`--config.KEY`, `optimizer.*` and `mesh.*` nested); ModelConfig's
are `model.overrides.*` (its groups nested: `model.overrides.rope.theta`, `model.overrides.execution.dtype`).
Allowed values come from the classes' CHOICES (and ModelConfig.ENTRY_CHOICES for tuples of kinds), which
their validation reads. docs/CONFIG.md is this module's --markdown output (tests/test_fields.py checks).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import io
import re
import sys
import tokenize
import typing
from typing import Optional

from tfm.config import ModelConfig
from tfm.train import TrainConfig

_SECTION = re.compile(r"^[A-Z][\w -]{0,30}$")  # "# Norms": a heading over fields, not a field's meaning


@dataclasses.dataclass(frozen=True)
class Field:
    key: str  # the config key, e.g. "model.overrides.rope.theta"
    type: str  # the annotation as written
    default: str
    allowed: str  # "" where any value of the type goes
    meaning: str


def _comments(cls) -> dict:
    """{field: its comment}: the comment on the field's line with the deeper-indented comment lines
    under it, else the comment block just above it (not a one-line section heading)."""
    source = inspect.getsource(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    lines = source.splitlines()
    comments = {t.start[0]: (t.start[1], t.string.lstrip("# ").strip())
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    out, block = {}, []
    for i, line in enumerate(lines, 1):
        stripped = line.strip()
        match = re.match(r"^    (\w+): ", line)
        if match and match.group(1) in names:
            name = match.group(1)
            if i in comments:  # inline, continued by deeper-indented comment-only lines
                parts, j = [comments[i][1]], i + 1
                while j in comments and lines[j - 1].strip().startswith("#") and comments[j][0] > 4:
                    parts.append(comments[j][1])
                    j += 1
                out[name] = " ".join(parts)
            elif block:
                out[name] = " ".join(block)
            block = []
        elif stripped.startswith("#") and line.startswith("    #"):
            block += [] if _SECTION.match(comments[i][1]) else [comments[i][1]]
        elif not stripped.startswith("#"):
            block = []
    return out


def _docstring_entries(cls) -> dict:
    """{field: text} from "name: text" paragraphs of the class docstring (continued on deeper lines)."""
    out, current = {}, None
    names = {f.name for f in dataclasses.fields(cls)}
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        match = re.match(r"^(\w+): (.*)", line)
        if match and match.group(1) in names:
            current = match.group(1)
            out[current] = match.group(2).strip()
        elif current and line.startswith("  ") and line.strip():
            out[current] += " " + line.strip()
        else:
            current = None
    return out


def _first_sentence(text: str) -> str:
    return re.split(r"(?<=\.)\s+(?=[A-Z])", text, maxsplit=1)[0]


def _allowed(cls, name: str) -> str:
    if name in getattr(cls, "CHOICES", {}):
        return ", ".join(map(repr, cls.CHOICES[name]))
    if name in getattr(cls, "ENTRY_CHOICES", {}):
        choices = cls.ENTRY_CHOICES[name]  # a tuple, or a function of none giving the registered kinds
        return "each of " + ", ".join(map(repr, choices() if callable(choices) else choices))
    return ""


_GROUP_MODULES = ("tfm.config", "tfm.train.config", "tfm.parallel.mesh")  # a config level's dataclasses


def _group(hint) -> Optional[type]:
    """The dataclass a field nests as a level of keys (OptimizerConfig, RopeConfig, ...), or None; a
    value given whole (attention_sparsity's patterns, attention_block_sizes) is not one."""
    for t in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(t) and t.__module__ in _GROUP_MODULES:
            return t
    return None


def fields_of(cls, prefix: str, outer: tuple = ()) -> list[Field]:
    """Every field of dataclass `cls` under key `prefix`, a nested group's after the field that holds it
    (not a class it is nested in: multimodal.vision is a whole ModelConfig)."""
    hints, comments, entries = typing.get_type_hints(cls), _comments(cls), _docstring_entries(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        group = _group(hints[f.name])
        meaning = comments.get(f.name) or _first_sentence(entries.get(f.name, ""))
        if group is not None and group not in (cls, *outer):
            doc = inspect.cleandoc(group.__doc__ or "").split("\n\n")[0].replace("\n", " ")
            meaning = meaning or ("" if doc.startswith(group.__name__ + "(") else _first_sentence(doc))
            nested.append((group, f"{prefix}{f.name}."))
        default = "required" if f.default is dataclasses.MISSING else repr(f.default)
        if dataclasses.is_dataclass(f.default):
            default = "(its fields' defaults)"
        rows.append(Field(prefix + f.name, str(f.type), default, _allowed(cls, f.name), meaning))
    for group, where in nested:
        rows += fields_of(group, where, (cls, *outer))
    return rows


@functools.lru_cache(maxsize=None)
def reference() -> dict:
    """{section title: its fields}: TrainConfig's (top-level keys), then ModelConfig's (model.overrides)."""
    return {"TrainConfig (`--config.KEY`)": fields_of(TrainConfig, ""),
            "ModelConfig (`--config.model.overrides.KEY`)": fields_of(ModelConfig, "model.overrides.")}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """docs/CONFIG.md: one table per section."""
    out = ["# Config fields", "",
           "Generated by `python -m experiments.fields --markdown` from the dataclasses (`tfm.train.TrainConfig`,",
           "`tfm.config.ModelConfig` and their groups); `tests/test_fields.py` fails when this file and the code",
           "disagree. Set any of them on a command line as `--config.KEY=VALUE`; in Python, ModelConfig's as",
           "`presets.build(preset, vocab_size, {...})` or `config.replace(...)`. A group's field set on a model",
           "whose switch is off (a RoPE field without `position='rope'`, a MoE field without `num_experts`, a",
           "mixer group no layer of `mixer_pattern` uses) is refused.", ""]
    for title, rows in reference().items():
        out += [f"## {title}", "", "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        out += [f"| `{r.key}` | `{_cell(r.type)}` | `{_cell(r.default)}` | {_cell(r.allowed)} | {_cell(r.meaning)} |"
                for r in rows]
        out.append("")
    return "\n".join(out)


def text(prefix: str = "") -> str:
    """The fields whose key starts with `prefix`, a block of lines each."""
    rows = [r for rows in reference().values() for r in rows if r.key.startswith(prefix)]
    if not rows:
        keys = sorted({r.key.rsplit(".", 1)[0] + "." for rows in reference().values() for r in rows if "." in r.key})
        raise ValueError(f"no config key starts with {prefix!r}; groups: {keys}")
    blocks = []
    for r in rows:
        blocks.append(f"{r.key}: {r.type} = {r.default}" + (f"\n    one of {r.allowed}" if r.allowed else "") + f"\n    {r.meaning}")
    return "\n".join(blocks)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prefix", nargs="?", default="", help="only keys starting with this")
    parser.add_argument("--markdown", action="store_true", help="all of them as docs/CONFIG.md")
    args = parser.parse_args(argv)
    try:
        print(markdown() if args.markdown else text(args.prefix))
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
