"""JSON Schema `format`s a string can be held to, each as a regex of strings that every checker
of that format accepts (jsonschema's FormatChecker among them).

Why narrower than the standards: a grammar only has to write valid values, not accept all of
them. Days stop at 28 (valid in every month), so a date needs no calendar; times carry a zone,
as RFC 3339 requires; e-mail addresses, host names and URIs are plain ASCII of bounded length,
which every reader accepts and which keeps the automaton small. A format not listed is refused
by name (runtime/grammar/schema.py), never passed as a free string.
"""
from __future__ import annotations

_YEAR = r"[1-9][0-9]{3}"
_DATE = _YEAR + r"-(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\x2e[0-9]{1,6})?(?:Z|[\x2b\x2d](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_LABEL = r"[a-z0-9](?:[a-z0-9\x2d]{0,20}[a-z0-9])?"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_HEX = "[0-9a-f]"

FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "T" + _TIME,
    "uuid": f"{_HEX}{{8}}\\x2d{_HEX}{{4}}\\x2d{_HEX}{{4}}\\x2d{_HEX}{{4}}\\x2d{_HEX}{{12}}",
    "email": r"[a-z0-9](?:[a-z0-9\x2e\x5f\x2d]{0,30}[a-z0-9])?\x40" + _LABEL + r"(?:\x2e" + _LABEL + r"){0,2}\x2e[a-z]{2,6}",
    "hostname": _LABEL + r"(?:\x2e" + _LABEL + r"){0,3}",
    "ipv4": _OCTET + r"(?:\x2e" + _OCTET + "){3}",
    "uri": r"https?\x3a\x2f\x2f" + _LABEL + r"(?:\x2e" + _LABEL + r"){0,3}(?:\x2f[a-zA-Z0-9\x2e\x5f\x7e\x2d]{1,20}){0,4}",
}
# automaton states of each (for the size estimate): its length in characters, a bound
STATES = {name: 24 + len(text) // 2 for name, text in FORMATS.items()}
