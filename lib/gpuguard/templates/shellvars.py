"""The variables a shell script or an environment dump sets, found without running anything (pure):
export/declare -x, plain and command-prefix assignments, `env A=B cmd`, `--export=ALL,A=B`, mpirun `-x A=B`,
`unset`, Python `os.environ[...] = ...`, and `env` / `/proc/PID/environ` dumps. What `gpuguard lint` reads."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_ASSIGN = re.compile(rf"^({_NAME})=(.*)$", re.S)
_PY_ENV = re.compile(rf"""os\.environ\[\s*['"]({_NAME})['"]\s*\]\s*=\s*(?:'([^'\n]*)'|"([^"\n]*)")""")
_PY_SETDEFAULT = re.compile(rf"""os\.environ\.setdefault\(\s*['"]({_NAME})['"]\s*,\s*(?:'([^'\n]*)'|"([^"\n]*)")""")


@dataclass(frozen=True)
class Assignment:
    name: str
    value: Optional[str]  # None: unset
    line: int
    text: str


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join backslash continuations; keep the number of the first physical line. Linear in the input."""
    out: list[tuple[int, str]] = []
    parts: list[str] = []
    start = 0
    for i, raw in enumerate(text.replace("\x00", "\n").splitlines(), 1):
        if not parts:
            start = i
        if raw.endswith("\\") and not raw.endswith("\\\\"):
            parts.append(raw[:-1])
            parts.append(" ")
            continue
        parts.append(raw)
        out.append((start, "".join(parts)))
        parts = []
    if parts:
        out.append((start, "".join(parts)))
    return out


_PLAIN = re.compile(r"[^\s'\"\\;&|()]+")
_DQ_RUN = re.compile(r'[^"\\]+')
_OPERATORS = frozenset(";&|()")
_SPECIAL = re.compile(r"['\"\\#;&|()]")
_WS = re.compile(r"[ \t\r\n\f\v]+")


def _split(line: str) -> list[str]:
    """The shell words of one line, like a shell splits them but without expanding anything: quotes removed,
    backslash escapes honoured, an unquoted `#` at the start of a word starts a comment, and ; & | ( ) && || are
    words of their own. Linear in the line's length (shlex appends to its token one character at a time: a 1 MB
    token took 39 s), and an unbalanced quote runs to the end of the line instead of failing."""
    if not _SPECIAL.search(line):
        return line.split()  # the common case: plain words
    words: list[str] = []
    buf: list[str] = []
    in_word = False
    i, n = 0, len(line)
    while i < n:
        c = line[i]
        if c in " \t\r\n\f\v" or c in _OPERATORS:
            if in_word:
                words.append("".join(buf))
                buf, in_word = [], False
            i = _skip_blanks(line, i) if c not in _OPERATORS else _operator(line, i, words)
            continue
        if c == "#" and not in_word:
            break
        in_word = True
        if c == "'":
            j = line.find("'", i + 1)
            buf.append(line[i + 1:] if j < 0 else line[i + 1:j])
            i = n if j < 0 else j + 1
        elif c == '"':
            i = _double_quoted(line, i + 1, buf)
        elif c == "\\":
            buf.append(line[i + 1:i + 2])
            i += 2
        else:
            m = _PLAIN.match(line, i)
            assert m is not None
            buf.append(m.group(0))
            i = m.end()
    if in_word:
        words.append("".join(buf))
    return words


def _skip_blanks(line: str, i: int) -> int:
    m = _WS.match(line, i)
    return m.end() if m else i + 1


def _operator(line: str, i: int, words: list[str]) -> int:
    """; & | ( ) as a word of its own, && and || too; returns where the next word may start."""
    c = line[i]
    if c in "&|" and i + 1 < len(line) and line[i + 1] == c:
        words.append(c + c)
        return i + 2
    words.append(c)
    return i + 1


def _double_quoted(line: str, i: int, buf: list[str]) -> int:
    """The inside of a double-quoted string starting at `i` into `buf`; returns the index past its closing quote
    (or past the end of the line)."""
    n = len(line)
    while i < n and line[i] != '"':
        m = _DQ_RUN.match(line, i)
        if m:
            buf.append(m.group(0))
            i = m.end()
        elif i + 1 < n and line[i + 1] in '\\"$`':  # a backslash escapes these inside double quotes
            buf.append(line[i + 1])
            i += 2
        else:
            buf.append(line[i])
            i += 1
    return i + 1  # the closing quote (or past the end)


def _from_export_list(spec: str, line: int, text: str) -> list[Assignment]:
    out = []
    for part in spec.split(","):
        m = _ASSIGN.match(part)
        if m:
            out.append(Assignment(m.group(1), m.group(2), line, text))
    return out


def parse_assignments(text: str) -> list[Assignment]:
    found: list[Assignment] = []
    for lineno, line in _logical_lines(text):
        stripped = line.strip()
        if not stripped:
            continue
        if not stripped.startswith("#"):
            for rx in (_PY_ENV, _PY_SETDEFAULT):
                for m in rx.finditer(line):
                    value = m.group(2) if m.group(2) is not None else m.group(3)
                    found.append(Assignment(m.group(1), value, lineno, stripped))
        if stripped.startswith("#"):
            m = re.match(r"^#SBATCH\s+--export=(\S+)", stripped)
            if m:
                found.extend(_from_export_list(m.group(1), lineno, stripped))
            continue
        words = _split(line)
        i = 0
        at_command_start = True
        while i < len(words):
            w = words[i]
            if w in (";", "&&", "||", "|", "&", "(", ")"):
                at_command_start = True
                i += 1
                continue
            if at_command_start and w in ("export", "declare", "typeset", "readonly", "local"):
                i += 1
                while i < len(words) and words[i] not in (";", "&&", "||", "|", "&"):
                    m = _ASSIGN.match(words[i])
                    if m:
                        found.append(Assignment(m.group(1), m.group(2), lineno, stripped))
                    i += 1
                continue
            if at_command_start and w == "unset":
                i += 1
                while i < len(words) and words[i] not in (";", "&&", "||", "|", "&"):
                    if re.fullmatch(_NAME, words[i]):
                        found.append(Assignment(words[i], None, lineno, stripped))
                    i += 1
                continue
            m = _ASSIGN.match(w)
            if m and (at_command_start or (i > 0 and words[i - 1] == "env") or
                      (i > 0 and _ASSIGN.match(words[i - 1]) is not None)):
                found.append(Assignment(m.group(1), m.group(2), lineno, stripped))
                i += 1
                continue
            if w.startswith("--export="):
                found.extend(_from_export_list(w[len("--export="):], lineno, stripped))
            elif w == "--export" and i + 1 < len(words):
                found.extend(_from_export_list(words[i + 1], lineno, stripped))
            elif w == "-x" and i + 1 < len(words) and _ASSIGN.match(words[i + 1]):  # mpirun -x A=B
                m2 = _ASSIGN.match(words[i + 1])
                assert m2
                found.append(Assignment(m2.group(1), m2.group(2), lineno, stripped))
            at_command_start = w == "env"
            i += 1
    return found


def final_environment(assignments: list[Assignment]) -> dict[str, Assignment]:
    """The last assignment of each variable still in force (an `unset` removes it)."""
    env: dict[str, Assignment] = {}
    for a in assignments:
        if a.value is None:
            env.pop(a.name, None)
        else:
            env[a.name] = a
    return env
