"""The documentation cannot drift from the code: the settings table and the list of per-run
settings are the settings' own declarations, and the README's and docs' links point at
files that exist."""
from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from ipcount.rules.config import PER_RUN_SETTINGS, REPO_ROOT, SETTINGS, SETTINGS_HELP, PipelineConfig

CONFIGURATION = REPO_ROOT / "docs" / "configuration.md"
MARKER = "<!-- settings table:"


def default_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    text = str(value)
    root = str(REPO_ROOT) + "/"
    return text[len(root):] if text.startswith(root) else text  # the warehouse, relative to the checkout


def settings_table() -> list[str]:
    """The table docs/configuration.md must hold, one row per setting, in field order."""
    rows = ["| setting | use | default | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        rows.append(f"| `{s.name}` | {s.use} | `{default_text(s.default)}` | {s.help} |")
    return rows


def documented_table(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(MARKER)) + 1
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append(line)
    return table


def test_the_settings_table_is_the_configs_own_help_text():
    expected = settings_table()
    assert documented_table(CONFIGURATION.read_text()) == expected, (
        "docs/configuration.md's settings table differs from SETTINGS_HELP; replace it with:\n"
        + "\n".join(expected))


def test_every_setting_has_help_text():
    assert set(SETTINGS_HELP) == {f.name for f in fields(PipelineConfig)} and all(SETTINGS_HELP.values())


def test_the_per_run_settings_the_docs_list_are_the_declared_ones():
    text = " ".join(CONFIGURATION.read_text().split())
    listed = text.split("or the CLI: ", 1)[1].split(". The topic", 1)[0]
    assert tuple(re.findall(r"`(\w+)`", listed)) == PER_RUN_SETTINGS


def test_links_between_the_readme_and_docs_point_at_files_that_exist():
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO_ROOT)} -> {target}")
    assert broken == []


def test_the_readme_stays_a_newcomers_page():
    assert len(Path(REPO_ROOT / "README.md").read_text().splitlines()) <= 200
