"""Words and variable expansion as Docker's builder does them (pure).

Two jobs, after BuildKit's ``frontend/dockerfile/parser`` and ``shell/lex.go``:

- :func:`split_words`: split an argument string on unquoted whitespace, keeping quotes
  and escapes in the words (``ENV``/``LABEL``/``ARG`` name=value lists); they are
  processed later, word by word.
- :class:`Expander`: one word with quotes removed and ``$VAR``, ``${VAR}``,
  ``${VAR:-word}``, ``${VAR-word}``, ``${VAR:+word}``, ``${VAR+word}``,
  ``${VAR:?message}`` and ``${VAR?message}`` replaced from an environment. Single
  quotes keep everything literal; inside double quotes the escape character escapes
  only ``"``, ``$`` and itself (others stay as written); outside quotes it escapes any
  character. An unset variable is the empty string, as in Docker. ``$1``, ``$@``, ``$$``
  and friends are looked up like names (Docker does the same: they are unset).

The escape character is ``\\`` unless the Dockerfile's ``# escape=`` directive says
`````. Errors are :class:`ExpansionError` (a ``ValueError``); the parser turns them into
:class:`hutch.errors.InvalidDockerfile` naming the line.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["Expander", "ExpansionError", "split_words"]

_SPECIAL_PARAMS = "*#?-@!$0"


class ExpansionError(ValueError):
    """A word that cannot be expanded: an unclosed quote or brace, a bad substitution,
    or ``${VAR?message}`` with VAR unset."""


def split_words(text: str, escape: str = "\\") -> list[str]:
    """``text`` split on whitespace outside quotes; quotes and escapes stay in the words
    (BuildKit ``parseWords``). An escape character at the very end is dropped."""
    words: list[str] = []
    word: list[str] = []
    in_word = False
    quote = ""
    blank_ok = False  # a word made only of quotes ("") is still a word
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if quote:
            if ch == quote:
                quote = ""
            elif ch == escape and quote != "'":
                if i + 1 == n:
                    break
                word.append(ch)
                i += 1
                ch = text[i]
            word.append(ch)
            i += 1
            continue
        if ch.isspace():
            if in_word and (word or blank_ok):
                words.append("".join(word))
            word, in_word, blank_ok = [], False, False
            i += 1
            continue
        in_word = True
        if ch in "'\"":
            quote = ch
            blank_ok = True
        elif ch == escape:
            if i + 1 == n:
                break
            word.append(ch)
            i += 1
            ch = text[i]
        word.append(ch)
        i += 1
    if in_word and (word or blank_ok):
        words.append("".join(word))
    return words


class _Words:
    """Collects the result of one word and, for :meth:`Expander.words`, where it splits:
    at unquoted whitespace written in the text and inside unquoted ``$VAR`` values."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.words: list[str] = []
        self.current: list[str] = []
        self.in_word = False

    def char(self, ch: str, splittable: bool) -> None:
        self.text.append(ch)
        if splittable and ch.isspace():
            self._end()
        else:
            self.current.append(ch)
            self.in_word = True

    def raw(self, s: str) -> None:
        self.text.append(s)
        self.current.append(s)
        self.in_word = True

    def expanded(self, s: str) -> None:
        for ch in s:
            self.char(ch, True)

    def _end(self) -> None:
        if self.in_word:
            self.words.append("".join(self.current))
        self.current, self.in_word = [], False

    def finish(self) -> tuple[str, list[str]]:
        self._end()
        return "".join(self.text), self.words


class Expander:
    """Expands words against ``env`` (a name → value mapping; absent = unset)."""

    def __init__(self, env: Mapping[str, str], escape: str = "\\") -> None:
        self.env = env
        self.escape = escape
        self._s = ""
        self._i = 0

    def word(self, text: str) -> str:
        """``text`` as one word: quotes removed, variables replaced."""
        return self._run(text)[0]

    def words(self, text: str) -> list[str]:
        """``text`` as several words (``EXPOSE $PORTS`` with PORTS="80 443")."""
        return self._run(text)[1]

    # -- the scanner --------------------------------------------------------------------

    def _run(self, text: str) -> tuple[str, list[str]]:
        self._s, self._i = text, 0
        out = _Words()
        self._process(out, stop=None)
        return out.finish()

    def _peek(self) -> str:
        return self._s[self._i] if self._i < len(self._s) else ""

    def _process(self, out: _Words, stop: str | None) -> None:
        """Up to ``stop`` (consumed; an error if never found) or the end."""
        while self._i < len(self._s):
            ch = self._s[self._i]
            if stop is not None and ch == stop:
                self._i += 1
                return
            if ch == "'":
                out.raw(self._single_quoted())
            elif ch == '"':
                out.raw(self._double_quoted())
            elif ch == "$":
                out.expanded(self._dollar())
            else:
                self._i += 1
                if ch == self.escape:
                    if self._i >= len(self._s):
                        break  # an escape at the very end is dropped
                    ch = self._s[self._i]
                    self._i += 1
                    out.raw(ch)
                else:
                    out.char(ch, True)
        if stop is not None:
            raise ExpansionError(f"syntax error: missing {stop!r}")

    def _single_quoted(self) -> str:
        start = self._i + 1
        end = self._s.find("'", start)
        if end < 0:
            raise ExpansionError("unexpected end of statement while looking for matching '")
        self._i = end + 1
        return self._s[start:end]

    def _double_quoted(self) -> str:
        self._i += 1
        out: list[str] = []
        while True:
            ch = self._peek()
            if not ch:
                raise ExpansionError('unexpected end of statement while looking for matching "')
            if ch == '"':
                self._i += 1
                return "".join(out)
            if ch == "$":
                out.append(self._dollar())
                continue
            self._i += 1
            if ch == self.escape:
                nxt = self._peek()
                if not nxt:
                    continue  # ignored at the end of the word
                if nxt in ('"', "$", self.escape):
                    ch = nxt
                    self._i += 1
            out.append(ch)

    def _name(self) -> str:
        s, i = self._s, self._i
        if i < len(s) and s[i].isdigit():
            j = i
            while j < len(s) and s[j].isdigit():
                j += 1
            self._i = j
            return s[i:j]
        if i < len(s) and s[i] in _SPECIAL_PARAMS:
            self._i = i + 1
            return s[i]
        j = i
        while j < len(s) and (s[j].isalnum() or s[j] == "_"):
            j += 1
        self._i = j
        return s[i:j]

    def _sub_word(self) -> str:
        """The word of a ``${NAME<op>word}``, up to the closing brace (quotes and
        nested variables processed)."""
        inner = _Words()
        self._process(inner, stop="}")
        return inner.finish()[0]

    def _dollar(self) -> str:
        self._i += 1  # the $
        if self._peek() != "{":
            name = self._name()
            return self.env.get(name, "") if name else "$"
        self._i += 1  # the {
        ch = self._peek()
        if not ch:
            raise ExpansionError("syntax error: missing '}'")
        if ch in "{}:":
            raise ExpansionError("syntax error: bad substitution")
        name = self._name()
        op = self._peek()
        if not op:
            raise ExpansionError("syntax error: missing '}'")
        self._i += 1
        value = self.env.get(name)
        if op == "}":
            return value or ""
        colon = op == ":"
        if colon:
            op = self._peek()
            if not op:
                raise ExpansionError("syntax error: missing '}'")
            self._i += 1
        if op not in "-+?":
            raise ExpansionError(
                f"unsupported substitution ${{{name}{':' if colon else ''}{op}...}}; supported: "
                "$VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:+alt}, ${VAR+alt}, "
                "${VAR:?message}, ${VAR?message}"
            )
        word = self._sub_word()
        present = bool(value) if colon else value is not None
        if op == "-":
            return value if present and value is not None else word
        if op == "+":
            return word if present else ""
        if not present:
            why = word or ("is not allowed to be empty" if colon and value == "" else
                           "is not allowed to be unset")  # fmt: skip
            raise ExpansionError(f"{name}: {why}")
        return value or ""
