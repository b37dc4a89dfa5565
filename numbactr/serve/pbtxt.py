"""A small, strict reader of protobuf's text format, the language of Triton's ``config.pbtxt``.

Triton reads ``config.pbtxt`` with protobuf's ``TextFormat`` against its ``ModelConfig`` message. numbactr
reads the same text without the message: the grammar below gives a tree of dicts, and
numbactr.serve.repository checks that tree against the fields the HugeCTR backend uses, so a wrong name
or type is an error naming the file and line instead of a silent default.

Grammar (the part of the text format Triton's examples use)::

    message := field*
    field   := NAME [":"] "{" message "}"          # a sub-message (also "<" message ">")
             | NAME [":"] "[" [value ("," value)*] "]"  # a repeated field written as a list
             | NAME ":" scalar
    value   := scalar | "{" message "}"
    scalar  := STRING | NUMBER | IDENT                 # IDENT: an enum name, true or false

Fields may be followed by "," or ";"; "#" starts a comment to the end of the line; adjacent strings
concatenate, as in protobuf. Every field may repeat: parse() gives ``{name: [Value, ...]}`` and each
Value keeps its line, so a later check can say where a value was written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["PbtxtError", "Value", "parse", "parse_file"]


class PbtxtError(ValueError):
    """A config.pbtxt that is not valid text format, or not what the HugeCTR backend takes (file:line)."""


@dataclass
class Value:
    """A field's value: a str, int, float, an ``Ident`` (enum name or bool) or a message dict, and its line."""

    value: object
    line: int


class Ident(str):
    """A bare identifier (an enum value such as TYPE_FP32, or true / false)."""


_TOKEN = re.compile(
    r"""(?P<space>[ \t\r]+)|(?P<newline>\n)|(?P<comment>\#[^\n]*)
    |(?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
    |(?P<number>[-+]?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|0[xX][0-9a-fA-F]+|\d+)[fF]?)
    |(?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    |(?P<punct>[{}<>\[\]:,;])""",
    re.VERBOSE,
)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "'": "'", "\\": "\\"}


def _tokens(text: str, path: str) -> list:
    """[(kind, text, line)] of text; an unknown character is a PbtxtError naming its line."""
    out, line, pos = [], 1, 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise PbtxtError(f"{path}:{line}: unexpected character {text[pos]!r}")
        kind = m.lastgroup
        if kind == "newline":
            line += 1
        elif kind not in ("space", "comment"):
            out.append((kind, m.group(), line))
        pos = m.end()
    return out


def _unquote(s: str, path: str, line: int) -> str:
    body, out, i = s[1:-1], [], 0
    while i < len(body):
        c = body[i]
        if c == "\\":
            nxt = body[i + 1]
            if nxt not in _ESCAPES:
                raise PbtxtError(f"{path}:{line}: unsupported escape \\{nxt} in {s}")
            out.append(_ESCAPES[nxt])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


class _Parser:
    def __init__(self, text: str, path: str):
        self.path, self.toks, self.i = path, _tokens(text, path), 0

    def _peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else ("eof", "end of file", self._last_line())

    def _last_line(self) -> int:
        return self.toks[-1][2] if self.toks else 1

    def _take(self, text: str | None = None, kind: str | None = None):
        tok = self._peek()
        if (text is not None and tok[1] != text) or (kind is not None and tok[0] != kind):
            want = repr(text) if text is not None else kind
            raise PbtxtError(f"{self.path}:{tok[2]}: expected {want}, found {tok[1]!r}")
        self.i += 1
        return tok

    def message(self, close: str | None) -> dict:
        fields: dict[str, list] = {}
        while True:
            kind, text, line = self._peek()
            if kind == "eof":
                if close is not None:
                    raise PbtxtError(f"{self.path}:{line}: end of file inside a message (missing {close!r})")
                return fields
            if text == close:
                self.i += 1
                return fields
            name = self._take(kind="ident")[1]
            fields.setdefault(name, []).extend(self.field_values(name))
            if self._peek()[1] in (",", ";"):
                self.i += 1

    def field_values(self, name: str) -> list:
        kind, text, line = self._peek()
        if text in ("{", "<"):
            self.i += 1
            return [Value(self.message("}" if text == "{" else ">"), line)]
        if text != "[":  # a list of messages may omit the colon: input [ {...}, {...} ]
            self._take(":")
        kind, text, line = self._peek()
        if text in ("{", "<"):
            self.i += 1
            return [Value(self.message("}" if text == "{" else ">"), line)]
        if text == "[":
            self.i += 1
            values = []
            while self._peek()[1] != "]":
                if values:
                    self._take(",")
                values.append(self.value())
            self.i += 1
            return values
        return [self.scalar(name)]

    def value(self) -> Value:
        kind, text, line = self._peek()
        if text in ("{", "<"):
            self.i += 1
            return Value(self.message("}" if text == "{" else ">"), line)
        return self.scalar("list element")

    def scalar(self, what: str) -> Value:
        kind, text, line = self._peek()
        self.i += 1
        if kind == "string":
            s = _unquote(text, self.path, line)
            while self._peek()[0] == "string":  # "a" "b" is "ab", as in protobuf
                s += _unquote(self._peek()[1], self.path, self._peek()[2])
                self.i += 1
            return Value(s, line)
        if kind == "number":
            t = text.rstrip("fF") if not text.lower().startswith(("0x", "-0x", "+0x")) else text
            if re.fullmatch(r"[-+]?(0[xX][0-9a-fA-F]+|\d+)", t):
                return Value(int(t, 0) if "x" in t.lower() else int(t), line)
            return Value(float(t), line)
        if kind == "ident":
            return Value(Ident(text), line)
        raise PbtxtError(f"{self.path}:{line}: expected a value for {what!r}, found {text!r}")


def parse(text: str, path: str = "<config.pbtxt>") -> dict:
    """The message of text as ``{name: [Value, ...]}`` (sub-messages as such dicts); PbtxtError names
    path and line."""
    return _Parser(text, path).message(None)


def parse_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise PbtxtError(f"{path}: cannot be read ({e})") from None
    return parse(text, path)
