"""YAML for the deploy tests: PyYAML when installed, else a small strict parser.

The fallback reads the block subset the files under deploy/ use (mappings, sequences,
`|` literals, quoted and plain scalars, one-line flow lists, `---` documents) and
raises on anything else (anchors, tags, folded scalars, flow mappings with content,
tabs), so it never returns a silently wrong tree. test_yamlish.py checks it against
PyYAML whenever PyYAML is importable.
"""

from __future__ import annotations

import json
import re
from typing import Any

try:  # pragma: no cover - depends on the environment
    import yaml as _pyyaml
except ImportError:  # pragma: no cover
    _pyyaml = None

HAVE_PYYAML = _pyyaml is not None


class YamlError(ValueError):
    pass


def load_all(text: str) -> list[Any]:
    """Every document of a YAML stream (empty documents dropped)."""
    if _pyyaml is not None:
        return [d for d in _pyyaml.safe_load_all(text) if d is not None]
    return load_all_fallback(text)


def load_all_fallback(text: str) -> list[Any]:
    docs: list[list[str]] = [[]]
    for line in text.splitlines():
        if line.rstrip() == "---":
            docs.append([])
        elif line.rstrip() == "...":
            continue
        else:
            docs[-1].append(line)
    out = []
    for lines in docs:
        parsed = _Parser(lines).document()
        if parsed is not None:
            out.append(parsed)
    return out


_INT = re.compile(r"[-+]?(0|[1-9][0-9]*)$")
_FLOAT = re.compile(r"[-+]?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$")
_KEY = re.compile(r"""^("(?:[^"\\]|\\.)*"|'(?:[^']|'')*'|[^\s'"\[\]{}#&*!|>%@`-][^:#]*?|-[^\s:][^:#]*?)\s*:(?:\s+|$)""")


def _indent(line: str) -> int:
    if "\t" in line[: len(line) - len(line.lstrip())]:
        raise YamlError(f"tab in indentation: {line!r}")
    return len(line) - len(line.lstrip(" "))


def _strip_comment(text: str) -> str:
    """The text without a trailing ` # comment` (a `#` inside quotes is kept)."""
    quote, i = "", 0
    while i < len(text):
        ch = text[i]
        if quote == '"':
            if ch == "\\":
                i += 1  # the escaped character
            elif ch == '"':
                quote = ""
        elif quote == "'":
            if ch == "'" and text[i + 1 : i + 2] == "'":
                i += 1  # '' is a quote inside single quotes
            elif ch == "'":
                quote = ""
        elif ch in "\"'" and (i == 0 or text[i - 1] in " [,:{"):
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] in " \t"):
            return text[:i].rstrip()
        i += 1
    if quote:
        raise YamlError(f"unterminated quote: {text!r}")
    return text.rstrip()


def _scalar(text: str) -> Any:
    text = _strip_comment(text).strip()
    if not text:
        return None
    if text[0] == '"':
        if not text.endswith('"') or len(text) < 2:
            raise YamlError(f"bad double-quoted scalar: {text!r}")
        return json.loads(text)
    if text[0] == "'":
        if not text.endswith("'") or len(text) < 2:
            raise YamlError(f"bad single-quoted scalar: {text!r}")
        return text[1:-1].replace("''", "'")
    if text[0] == "[":
        if not text.endswith("]"):
            raise YamlError(f"multi-line flow sequences are not supported: {text!r}")
        inner = text[1:-1].strip()
        if not inner:
            return []
        if any(c in inner for c in "[]{}"):
            raise YamlError(f"nested flow collections are not supported: {text!r}")
        return [_scalar(part) for part in _split_flow(inner)]
    if text[0] == "{":
        if text == "{}":
            return {}
        raise YamlError(f"flow mappings are not supported: {text!r}")
    if text[0] in "&*!|>%@`":
        raise YamlError(f"unsupported YAML construct: {text!r}")
    if text in ("null", "Null", "NULL", "~"):
        return None
    if text in ("true", "True", "TRUE"):
        return True
    if text in ("false", "False", "FALSE"):
        return False
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    if text.startswith("0") and len(text) > 1 and text[1:].isdigit():
        raise YamlError(f"octal-looking number, write it quoted or in decimal: {text!r}")
    if ": " in text or text.endswith(":"):
        raise YamlError(f"ambiguous plain scalar (quote it): {text!r}")
    return text


def _split_flow(inner: str) -> list[str]:
    parts, quote, start = [], "", 0
    for i, ch in enumerate(inner):
        if quote:
            if ch == quote and inner[i - 1] != "\\":
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch == ",":
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    return [p.strip() for p in parts]


class _Parser:
    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.i = 0

    def _skip(self) -> None:
        while self.i < len(self.lines):
            stripped = self.lines[self.i].strip()
            if stripped and not stripped.startswith("#"):
                return
            self.i += 1

    def _peek(self) -> tuple[int, str] | None:
        self._skip()
        if self.i >= len(self.lines):
            return None
        line = self.lines[self.i]
        return _indent(line), line.strip()

    def document(self) -> Any:
        head = self._peek()
        if head is None:
            return None
        value = self._block(head[0])
        if self._peek() is not None:
            raise YamlError(f"unexpected line: {self.lines[self.i]!r}")
        return value

    def _block(self, indent: int) -> Any:
        head = self._peek()
        assert head is not None
        if head[1] == "-" or head[1].startswith("- "):
            return self._sequence(indent)
        if _KEY.match(head[1]):
            return self._mapping(indent)
        value = _scalar(head[1])
        self.i += 1
        return value

    def _sequence(self, indent: int) -> list[Any]:
        items: list[Any] = []
        while (head := self._peek()) is not None and head[0] == indent and (head[1] == "-" or head[1].startswith("- ")):
            rest = head[1][1:].lstrip()
            if not rest or rest.startswith("#"):
                self.i += 1
                nxt = self._peek()
                items.append(self._block(nxt[0]) if nxt is not None and nxt[0] > indent else None)
                continue
            # "- key: value" opens a mapping (or a nested "- -" a sequence) at the item's column.
            column = indent + len(head[1]) - len(rest)
            if _KEY.match(rest) or rest == "-" or rest.startswith("- "):
                self.lines[self.i] = " " * column + rest
                items.append(self._block(column))
            else:
                items.append(_scalar(rest))
                self.i += 1
        if head is not None and head[0] > indent:
            raise YamlError(f"bad indentation: {self.lines[self.i]!r}")
        return items

    def _mapping(self, indent: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        while (head := self._peek()) is not None and head[0] == indent:
            match = _KEY.match(head[1])
            if match is None:
                if head[1] == "-" or head[1].startswith("- "):
                    break
                raise YamlError(f"expected 'key: value': {self.lines[self.i]!r}")
            key = _scalar(match.group(1))
            if not isinstance(key, str):
                key = str(key)
            if key in out:
                raise YamlError(f"duplicate key {key!r}")
            rest = _strip_comment(head[1][match.end():]).strip()
            self.i += 1
            if rest in ("|", "|-", "|+"):
                out[key] = self._literal(indent, rest)
            elif rest.startswith((">", "|")):
                raise YamlError(f"unsupported block scalar header {rest!r}")
            elif rest:
                out[key] = _scalar(rest)
            else:
                nxt = self._peek()
                if nxt is not None and (nxt[0] > indent or (nxt[0] == indent and (nxt[1] == "-" or nxt[1].startswith("- ")))):
                    out[key] = self._block(nxt[0])
                else:
                    out[key] = None
        if head is not None and head[0] > indent:
            raise YamlError(f"bad indentation: {self.lines[self.i]!r}")
        return out

    def _literal(self, indent: int, header: str) -> str:
        body: list[str] = []
        block_indent = None
        while self.i < len(self.lines):
            line = self.lines[self.i]
            if line.strip():
                ind = _indent(line)
                if ind <= indent:
                    break
                if block_indent is None:
                    block_indent = ind
                if ind < block_indent:
                    raise YamlError(f"literal block line less indented than its first: {line!r}")
                body.append(line[block_indent:])
            else:
                body.append("")
            self.i += 1
        while body and body[-1] == "" and header != "|+":
            body.pop()
        text = "\n".join(body)
        if header == "|-" or not body:
            return text
        return text + "\n"
