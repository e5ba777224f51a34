"""Where a JSON text cut anywhere stands, and what completes it: the open strings, arrays and objects, and whether a
key or a value is pending.

`JsonPrefix` follows the text byte by byte (UTF-8, as a grammar sees it). `closing()` is the shortest text that
makes it a whole JSON value (a pending value becomes `null`, a pending key `"_"`, a cut number or literal is
finished); `candidates()` orders the bytes worth trying next when a grammar must approve each one (the closing text's
first byte, then what else may stand there). Pure Python: no grammar, no tokenizer.
"""

from __future__ import annotations

import copy
from enum import Enum

_WS = b" \t\r\n"
_NUMBER = b"0123456789+-.eE"
_LITERALS = (b"true", b"false", b"null")
_LETTERS = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789"
_HEX = b"0123456789abcdefABCDEF"
_VALUE_STARTS = b'n0"ft[{-123456789'
# The first continuation byte that keeps a cut UTF-8 character valid, by its lead byte (others take 0x80)
_FIRST_CONTINUATION = {0xE0: 0xA0, 0xF0: 0x90}


class Expect(Enum):
    """What may come next outside a string."""

    VALUE = "value"
    VALUE_OR_END = "value or ]"
    KEY = "key"
    KEY_OR_END = "key or }"
    COLON = ":"
    COMMA_OR_END = ", or the container's end"
    DONE = "nothing: the value is whole"


class JsonPrefix:
    """The state of the JSON text fed so far. `broken` once the text is not the start of any JSON value."""

    def __init__(self) -> None:
        self.stack: list[int] = []  # the open containers, `{` or `[`, innermost last
        self.expect = Expect.VALUE
        self.in_string = False
        self.key = False  # the open string is an object key
        self.string_bytes = 0  # bytes of the open string so far
        self.escape = 0  # in a string: 0 none, -1 right after `\`, n > 0 the hex digits a `\u` still needs
        self.utf8 = 0  # continuation bytes the string's last character still needs
        self.lead = 0  # that character's lead byte
        self.atom = b""  # the number or literal being written
        self.broken = False

    def copy(self) -> JsonPrefix:
        return copy.deepcopy(self)

    @property
    def complete(self) -> bool:
        """The text is a whole JSON value (a top-level number could still grow)."""
        if self.broken or self.in_string or self.stack:
            return False
        return self.expect is Expect.DONE or (bool(self.atom) and not self._atom_tail())

    def feed(self, data: bytes) -> None:
        for byte in data:
            if self.broken:
                return
            if self.in_string:
                self._string_byte(byte)
            else:
                self._byte(byte)

    def closing(self) -> bytes:
        """The shortest text that makes the prefix a whole JSON value (empty when it is one; b"" when broken)."""
        if self.broken:
            return b""
        out = bytearray()
        expect = self.expect
        if self.in_string:
            out += self._string_tail()
            expect = Expect.COLON if self.key else self._after_value()
        elif self.atom:
            out += self._atom_tail()
            expect = self._after_value()
        out += {Expect.VALUE: b"null", Expect.KEY: b'"_": null', Expect.COLON: b": null"}.get(expect, b"")
        out += bytes(ord("}") if opener == ord("{") else ord("]") for opener in reversed(self.stack))
        return bytes(out)

    def candidates(self) -> bytes:
        """The bytes to try next, best first: the closing text's first byte, then what else is valid here (a
        grammar may refuse the first: a required key, an enum's value, a number's minimum)."""
        if self.broken or self.expect is Expect.DONE:
            return b""
        first = self.closing()[:1]
        if self.in_string:
            rest = (_HEX if self.escape > 0 else b'\\n"' if self.escape < 0 else
                    bytes(range(0x80, 0xC0)) if self.utf8 else b'"' + _LETTERS + b" -.")
        elif self.atom:
            rest = b"0123456789" + b",}] " if self.atom[:1] in b"-0123456789" else b""
        else:
            rest = {Expect.VALUE: _VALUE_STARTS, Expect.VALUE_OR_END: b"]" + _VALUE_STARTS, Expect.KEY: b'"',
                    Expect.KEY_OR_END: b'}"', Expect.COLON: b":", Expect.COMMA_OR_END: b",}]"}.get(self.expect, b"")
            rest += b" "  # compact JSON's separators are `, ` and `: `
        return first + bytes(byte for byte in rest if bytes([byte]) != first)

    # ------------------------------------------------------------ following the text

    def _byte(self, byte: int) -> None:
        if self.atom:
            if self._atom_grows(byte):
                self.atom += bytes([byte])
                return
            self.atom = b""
            self._value_done()
        char = bytes([byte])
        if char in _WS:
            return
        starts_value = self.expect in (Expect.VALUE, Expect.VALUE_OR_END)
        if char in b"{[" and starts_value:
            self.stack.append(byte)
            self.expect = Expect.KEY_OR_END if char == b"{" else Expect.VALUE_OR_END
        elif char == b'"' and (starts_value or self.expect in (Expect.KEY, Expect.KEY_OR_END)):
            self.in_string, self.key, self.string_bytes = True, self.expect in (Expect.KEY, Expect.KEY_OR_END), 0
        elif char in b"}]" and self._closes(byte):
            self.stack.pop()
            self._value_done()
        elif char == b":" and self.expect is Expect.COLON:
            self.expect = Expect.VALUE
        elif char == b"," and self.expect is Expect.COMMA_OR_END:
            self.expect = Expect.KEY if self.stack[-1] == ord("{") else Expect.VALUE
        elif starts_value and (char in b"-0123456789" or any(word[:1] == char for word in _LITERALS)):
            self.atom = char
        else:
            self.broken = True

    def _closes(self, byte: int) -> bool:
        if not self.stack:
            return False
        if byte == ord("}"):
            return self.stack[-1] == ord("{") and self.expect in (Expect.KEY_OR_END, Expect.COMMA_OR_END)
        return self.stack[-1] == ord("[") and self.expect in (Expect.VALUE_OR_END, Expect.COMMA_OR_END)

    def _string_byte(self, byte: int) -> None:
        self.string_bytes += 1
        if self.utf8:
            self.utf8 -= 1
        elif self.escape < 0:
            self.escape = 4 if byte == ord("u") else 0
        elif self.escape > 0:
            self.escape -= 1
        elif byte == ord("\\"):
            self.escape = -1
        elif byte == ord('"'):
            self.in_string = False
            if self.key:
                self.expect = Expect.COLON
            else:
                self._value_done()
        elif byte >= 0xC0:
            self.utf8, self.lead = (1 if byte < 0xE0 else 2 if byte < 0xF0 else 3), byte

    def _value_done(self) -> None:
        self.expect = self._after_value()

    def _after_value(self) -> Expect:
        return Expect.COMMA_OR_END if self.stack else Expect.DONE

    def _atom_grows(self, byte: int) -> bool:
        if self.atom[:1] in b"-0123456789":
            return byte in _NUMBER
        return any(word.startswith(self.atom + bytes([byte])) for word in _LITERALS)

    def _atom_tail(self) -> bytes:
        """What finishes the number or literal being written (b"" when it is whole)."""
        if self.atom[:1] in b"-0123456789":
            return b"0" if self.atom[-1:] in b"-+.eE" else b""
        word = next((word for word in _LITERALS if word.startswith(self.atom)), self.atom)
        return word[len(self.atom):]

    def _string_tail(self) -> bytes:
        """What closes the open string: its cut character or escape finished, a key made non-empty, the quote."""
        out = bytearray()
        if self.utf8:
            out.append(_FIRST_CONTINUATION.get(self.lead, 0x80) if self._first_continuation() else 0x80)
            out += b"\x80" * (self.utf8 - 1)
        elif self.escape < 0:
            out += b"\\"
        elif self.escape > 0:
            out += b"0" * self.escape
        elif self.key and self.string_bytes == 0:
            out += b"_"
        return bytes(out) + b'"'

    def _first_continuation(self) -> bool:
        """The cut character has no continuation byte yet."""
        needed = 1 if self.lead < 0xE0 else 2 if self.lead < 0xF0 else 3
        return self.utf8 == needed
