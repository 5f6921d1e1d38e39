"""The documentation is a user's way in, so it must not drift from the code: its links lead
somewhere, the README's command table names every command the CLI has, every option of the
commands a user runs by hand is documented, every `kvrt ...` command the docs quote is one the CLI
still accepts, and the README stays an entry point rather than a manual. The docs stand alone:
nothing outside the repository is linked."""
from __future__ import annotations

import contextlib
import functools
import io
import os
import re

import pytest

from kvrt import launcher
from tests.conftest import REPO

DOCS = ["README.md"] + [f"docs/{n}" for n in sorted(os.listdir(f"{REPO}/docs")) if n.endswith(".md")]
README_MAX_LINES = 300
# commands a user types by hand: every option of theirs is documented in the README or the guide
# (the benchmarks' options are documented by their own --help)
USER_COMMANDS = [("serve",), ("launch",), ("status",), ("clean",), ("generate",), ("replay",), ("route",), ("store", "start")]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


def text(doc: str) -> str:
    with open(f"{REPO}/{doc}", encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def help_text(command: tuple[str, ...]) -> str:
    """What `kvrt COMMAND --help` prints, from the real parsers, in this process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        launcher.main([*command, "--help"])
    return out.getvalue()


def usage_flags(command: tuple[str, ...]) -> set[str]:
    """The options of a command, from its usage block (argparse lists every option there once)."""
    usage = help_text(command).split("\n\n")[0]
    flags = set(FLAG.findall(usage)) | {"--help"}
    if command == ("serve",):  # kvrt launch's own flags pass through kvrt serve
        flags |= usage_flags(("launch",))
    return flags


def top_level_commands() -> list[str]:
    """The subcommands `kvrt --help` lists."""
    block = help_text(()).split("positional arguments:")[1].split("\n\n")[0]
    return re.findall(r"^ {4}([a-z]+)\b", block, re.M)


def all_commands() -> list[tuple[str, ...]]:
    """Every command path: `launch`, ..., `bench NAME` for each benchmark, `store start`."""
    paths: list[tuple[str, ...]] = []
    for c in top_level_commands():
        if c == "bench":
            paths += [("bench", b) for b in launcher.BENCHES]
        elif c == "stress":
            paths += [("stress", s) for s in launcher.STRESS]
        elif c == "store":
            paths.append(("store", "start"))
        else:
            paths.append((c,))
    return paths


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"[`*]", "", heading.strip().lower())
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def anchors(doc: str) -> set[str]:
    body = FENCE.sub("", text(doc))
    found: set[str] = set(re.findall(r'<a id="([^"]+)"></a>', body))
    seen: dict[str, int] = {}
    for h in re.findall(r"^#{1,6} (.+)$", body, re.M):
        s = slug(h)
        found.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return found


def links(doc: str) -> list[str]:
    body = re.sub(r"`[^`\n]*`", "", FENCE.sub("", text(doc)))
    return re.findall(r"\]\(([^)\s]+)\)", body)


def quoted_commands(doc: str) -> list[str]:
    """Every `kvrt ...` command a doc quotes: inline code spans and lines of code blocks."""
    body = text(doc)
    found = [s for s in re.findall(r"`([^`\n]+)`", FENCE.sub("", body)) if s.startswith("kvrt ")]
    for block in FENCE.findall(body):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("kvrt "):
                found.append(line)
    return found


def test_the_readme_is_an_entry_point():
    lines = text("README.md").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; details belong in docs/"


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_and_anchor_resolves(doc):
    here = os.path.dirname(f"{REPO}/{doc}")
    broken = []
    for target in links(doc):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(here, path)) if path else f"{REPO}/{doc}"
        if not file.startswith(REPO + os.sep) or not os.path.exists(file):
            broken.append(f"{target} (no such file in the repository)")
        elif anchor and file.endswith(".md") and anchor not in anchors(os.path.relpath(file, REPO)):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc}: {broken}"


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_stand_alone(doc):
    """The design folder next to the repository is not shipped with it."""
    assert "shared/design" not in text(doc)


def test_the_readme_command_table_names_every_command():
    rows = [line for line in text("README.md").splitlines() if line.startswith("| `kvrt ")]
    missing = [" ".join(c) for c in all_commands()
               if not any(row.startswith(f"| `kvrt {' '.join(c)}") for row in rows)]
    assert not missing, f"commands missing from the README's table: {missing}"


@pytest.mark.parametrize("command", USER_COMMANDS, ids=" ".join)
def test_every_option_of_a_user_command_is_documented(command):
    docs = text("README.md") + text("docs/guide.md")
    missing = sorted(f for f in usage_flags(command) - {"--help"} if not re.search(re.escape(f) + r"(?![\w-])", docs))
    assert not missing, f"kvrt {' '.join(command)}: options documented in neither README.md nor docs/guide.md: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_quoted_command_is_one_the_cli_accepts(doc):
    """A figure's command that no longer works must be said to be stale, not quoted as current."""
    known = {c[:2] if c[0] in ("bench", "stress", "store") else c[:1] for c in all_commands()}
    wrong = []
    for quoted in quoted_commands(doc):
        words = quoted.split()[1:]
        if not words or words[0] in ("COMMAND", "...") or words[0].startswith("-") or words[0].endswith(":"):
            continue  # `kvrt --help`, a placeholder, or a message the CLI prints (`kvrt launch: error: ...`)
        path = tuple(words[:2]) if words[0] in ("bench", "stress", "store") else tuple(words[:1])
        if len(path) == 2 and (path[1].isupper() or path[1] == "--help"):
            continue  # `kvrt bench NAME`: a placeholder; `kvrt bench --help`: the list of names
        if path not in known:
            wrong.append(f"{quoted!r}: no command `kvrt {' '.join(path)}`")
            continue
        unknown = {f for f in FLAG.findall(quoted)} - usage_flags(path)
        if unknown:
            wrong.append(f"{quoted!r}: `kvrt {' '.join(path)}` has no {sorted(unknown)}")
    assert not wrong, f"{doc}: {wrong}"
