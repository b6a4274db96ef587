"""The README, benchmarks/README.md and docs/ name only what exists: every repository path they
mention is a file or folder (or the prefix of result files) of this checkout, every benchmark script a
command runs exists and takes each flag the command gives it, and every `tokenrouter` command's flags
are its parser's; every script under benchmarks/ is in benchmarks/README.md's studies."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from tokenrouter import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A path of the checkout, bare or after "./" (not inside another path, a URL or a home folder).
PATH = re.compile(r"(?:(?<=\./)|(?<![\w/.~$-]))((?:benchmarks|scripts|tokenrouter|tests|docs|examples)/[\w./*-]*\w)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")


def commands(text: str) -> list[str]:
    """The command lines of a document: fenced blocks (continuation lines joined), indented lines
    that run something from the checkout, and inline code."""
    found = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        found += [line.strip() for line in re.sub(r"\\\n\s*", " ", block).splitlines() if line.strip()]
    found += [line.strip() for line in text.splitlines() if re.match(r" {4}(\./|\.venv/|OMP_)", line)]
    return found + re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def exists(path: str) -> bool:
    """A file or folder of the checkout, a glob matching one, or under docs/bench/ the prefix of the
    result files a command writes there."""
    target = ROOT / path
    if target.exists() or ("*" in target.name and any(target.parent.glob(target.name))):
        return True
    return path.startswith("docs/bench/") and any(target.parent.glob(target.name + "*"))


def parses(code: str, flag: str) -> bool:
    """Whether a script's source declares `flag` in an add_argument call."""
    return re.search(r"add_argument\([^)]*[\"']" + re.escape(flag) + r"[\"']", code) is not None


def options(parser: argparse.ArgumentParser, prefix: str = "") -> set[str]:
    """Every option string of a parser and its subcommands ("sub:--flag" for a subcommand's own)."""
    found = set()
    for action in parser._actions:
        found |= {prefix + o for o in action.option_strings}
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= options(sub, f"{prefix}{name}:")
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_document_names_exists(doc: Path) -> None:
    missing = [f"{doc.name}:{n}: {m.group(1)}" for n, line in enumerate(doc.read_text().splitlines(), 1)
               for m in PATH.finditer(line) if not exists(m.group(1).rstrip("."))]
    assert not missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_a_document_gives_runs_as_written(doc: Path) -> None:
    """Each benchmark script a command names exists and parses each flag given to it; each
    `tokenrouter SUBCOMMAND` flag belongs to that subcommand (or its own subcommand's)."""
    known = options(cli.build_parser())
    wrong = []
    for cmd in commands(doc.read_text()):
        script = re.search(r"(benchmarks/[\w-]+\.py)(.*)", cmd)
        if script:
            source = ROOT / script.group(1)
            code = source.read_text() if source.is_file() else ""
            wrong += [f"{script.group(1)} {flag}: {cmd}" for flag in FLAG.findall(script.group(2))
                      if not parses(code, flag)] or ([] if code else [cmd])
            continue
        sub = re.search(r"(?:^|[\s/])tokenrouter\s+([a-z][\w-]*)(\s+[a-z][\w-]*)?(.*)", cmd)
        if sub and any(o.startswith(sub.group(1) + ":") for o in known):
            own = f"{sub.group(1)}:{sub.group(2).strip()}:" if sub.group(2) else None
            rest = (sub.group(2) or "") + sub.group(3)
            wrong += [f"tokenrouter {sub.group(1)} {flag}: {cmd}" for flag in FLAG.findall(rest)
                      if f"{sub.group(1)}:{flag}" not in known and (own is None or own + flag not in known)]
    assert not wrong


def test_every_benchmark_script_belongs_to_a_study() -> None:
    index = (ROOT / "benchmarks" / "README.md").read_text()
    unlisted = [p.name for p in sorted((ROOT / "benchmarks").iterdir())
                if p.suffix in (".py", ".sh") and f"benchmarks/{p.name}" not in index]
    assert not unlisted


def test_a_flag_no_script_or_subcommand_takes_is_caught(tmp_path: Path, monkeypatch) -> None:
    doc = tmp_path / "bad.md"
    doc.write_text("```\n.venv/bin/python benchmarks/quality_unseen.py --no-such-flag 1\n"
                   "tokenrouter serve --port 1 --no-such-option\n```\nSee `benchmarks/no_such_script.py`,\n"
                   "run ./scripts/no_such_setup.sh and read tokenrouter/engine/step (a cut-short name).\n")
    with pytest.raises(AssertionError, match="no-such-flag"):
        test_every_command_a_document_gives_runs_as_written(doc)
    with pytest.raises(AssertionError, match="no-such-option"):
        test_every_command_a_document_gives_runs_as_written(doc)
    with pytest.raises(AssertionError, match="no_such_script") as failed:
        test_every_path_a_document_names_exists(doc)
    assert "scripts/no_such_setup.sh" in str(failed.value) and "tokenrouter/engine/step'" in str(failed.value)
