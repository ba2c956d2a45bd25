"""Every figure the README or the docs report names, beside it, the results file that holds it.

A *figure* is a number that reports a measurement of ours:

* in a sentence, a number with a unit: a time (`13.8 s`, `52.5 ms`, `43 minutes`), a ratio
  (`2.43x`), a share (`1.8%`), a size or a bandwidth (`1.6 GB`, `7.47 GiB`, `2.98 TB/s`), a
  rate (`141.7 tok/s`, tokens per second), steps to a threshold (`85 steps to 0.75`); or a
  pass rate or a divergence written to three or more decimals (`0.719`, `0.0077`);
* in a table, every number after a row's first cell, when the header names a measurement
  (`time (s)`, `tok/s`, `pass`, `x sync`, ...) or a cell is a number with a unit alone.

Not figures: numbers in code blocks and code spans (commands, settings); a setting, a limit or a
product of them, written after "at most", "up to", "every", "within", "after", "bound", "x" and
the like (`at most 60 s`, `every 50 steps`); the size of a device (`a 24 GB GPU`, an H100 80GB);
counts of things (`164 problems`) and numbers in a table whose header names no measurement.

*Beside it* means in the same section, from the nearest heading above the figure to the next
heading of the same or a higher level (a section's sub-sections belong to it; a page's title
owns only the lines before its first sub-heading), and the section names a results file that
exists: a `bench/results/<machine>/<name>.json` path or a `results/<machine>/<name>.json` link
(docs/hooks/results_files.py serves bench/results/ there).

A number that is not a measurement of ours (one quoted from a paper or an upstream doc, the size
a test asks for) is exempted by a comment on its line, `<!-- figure: not ours (where it comes
from) -->`; the same comment on the line above a table exempts the table. `grep -rn
"figure:" README.md docs` lists them. A section allowed to wait for its results file is listed
in KNOWN with the reason, and only while it still holds a figure without one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT

RESULTS = ROOT / "bench" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
"""The README and every page of the docs site."""

KNOWN: dict[tuple[str, str], str] = {}
"""(file, heading) of each section allowed to hold figures without a results file, mapped to the
reason. Empty: the README's Results table, being rerun, names the file it came from
(bench/results/h100/time_to_threshold.json) and passes as it stands."""

OPENS = re.compile(r"^ *(`{3,}(?=[^`]*$)|~{3,})")
"""A code block's first line: three or more backticks (no backtick after them) or tildes."""
SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.DOTALL)
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
HEADING = re.compile(r"^(#{1,6}) +(.+?) *#* *$")
EXEMPT = re.compile(r"<!--\s*figure:[^>]*-->")
RESULTS_FILE = re.compile(r"(?<![\w.-])(?:bench/|(?:\.\./)*)results/([\w.-]+)/([\w.-]+\.json)\b")

NUMBER = r"(?<![\w.,/-])~?\d[\d,]*(?:\.\d+)?(?:\s?[-–]\s?\d[\d,]*(?:\.\d+)?)?"
"""A number, a range of two (5-7) or an approximate one (~25), not part of a word or a path."""
UNIT = re.compile(NUMBER + r"""(?:
      \s(?:s|ms|us|µs|min|minutes|seconds|hours?)\b      # a time (410s is a plural)
    | x(?![\w*])                                    # a ratio: 2.43x (not 0x1f, not 2 x 3)
    | \s?%                                          # a share
    | \s(?:GB|GiB|MB|MiB|KiB|TB)(?:/s)?\b          # a size or a bandwidth (an H100 80GB is a product)
      (?!\s+(?:GPUs?|cards?|one|of\ RAM|RAM)\b)     # the size of a device is not a figure
    | \s(?:tok/s|tokens/s|tokens\ per\ second)      # a rate
    | \s(?:RL\ )?steps\ to\ (?:0\.\d+|\d\.\d\d)     # steps to a threshold
    )""", re.VERBOSE)
DECIMAL = re.compile(r"(?<![\w.,/=-])[01]\.\d{3,}(?![\w.])")
"""A pass rate or a divergence written to three or more decimals (0.719, 0.0077)."""
NOT_A_FIGURE = re.compile(
    r"(?:\bat most|\bat least|\bup to|\bunder|\bbelow|\babove|\bover|\bevery|\beach|\bwithin|"
    r"\bafter|\blimit(?:ed)?(?: to| of)?|\btimeout|\bbound|\bbudget(?: of)?|\bdefault(?:s)?(?: of| is)?|"
    r"\bcap(?:ped)?(?: at| to)?|\bfor|\bx|=)\s*\(?\s*$", re.IGNORECASE)
"""What, written just before a number, makes it a setting, a limit or a product of them rather
than a measurement: "at most 60 s", "every 50 steps", "the stop's bound (60 s", "limit x 1 GiB"."""
MEASURED_HEADER = re.compile(r"\((?:s|ms|us|GB|GiB|MB|MiB|%|x)\)|tok/s|tokens/s|"
                             r"\b(?:time|pass|rate|speed|held-out|reward|s per step|ms|x|kl|seconds|wall)\b",
                             re.IGNORECASE)
"""A table header that says its columns hold measurements."""
TABLE_NUMBER = re.compile(r"(?<![\w.,/-])\d[\d,]*(?:\.\d+)?(?![\w.])")
"""A number in a cell of a table whose header names a measurement (its unit is in the header)."""
ROW_RULE = re.compile(r"^\s*\|[\s|:-]*\|\s*$")
"""The line under a table's header."""


@dataclass(frozen=True)
class Figure:
    file: str
    line: int
    heading: str
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.heading}): {self.text}"


def blank(match: re.Match) -> str:
    """The match with everything but its line breaks blanked, so line numbers stay."""
    return re.sub(r"[^\n]", " ", match.group(0))


def without_blocks(text: str) -> str:
    """The text with its fenced code blocks blanked, line for line. A block runs to a line of
    at least as many of its opening characters, or to the end of the text (as CommonMark has it)."""
    lines = text.split("\n")
    fence = None
    for i, line in enumerate(lines):
        if fence is None:
            if not (m := OPENS.match(line)):
                continue
            fence = m.group(1)
        elif re.fullmatch(rf" *{fence[0]}{{{len(fence)},}} *", line):
            fence = None
        lines[i] = ""
    return "\n".join(lines)


def prose(text: str) -> str:
    """The text with code blocks, code spans, comments and link targets blanked."""
    text = without_blocks(text)
    for pattern in (SPAN, COMMENT, LINK_TARGET):
        text = pattern.sub(blank, text)
    return text


def sections(text: str) -> list[tuple[str, int, int]]:
    """(heading, first line, end line) of each section: a heading's lines run to the next heading
    of the same or a higher level; a level-1 heading's (a page's title) to the next heading at all.
    The lines before the first heading are a section of their own, headed ''."""
    lines = without_blocks(text).splitlines()
    heads = [(i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines)
             if (m := HEADING.match(line))]
    found = [("", 0, heads[0][0] if heads else len(lines))]
    for k, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[k + 1:] if lv <= level or level == 1), len(lines))
        found.append((title, i, end))
    return found


def results_files(text: str) -> set[str]:
    """The results files of bench/results/ that `text` names and that exist."""
    return {f"{machine}/{name}" for machine, name in RESULTS_FILE.findall(text)
            if (RESULTS / machine / name).is_file()}


def tables(plain: list[str]) -> dict[int, tuple[int, bool]]:
    """Each table row's line (0-based), mapped to its header's line and whether the table holds
    figures: its header names a measurement, or one of its cells is a number with a unit alone."""
    found: dict[int, tuple[int, bool]] = {}
    i = 0
    while i < len(plain):
        if not plain[i].lstrip().startswith("|"):
            i += 1
            continue
        end = i
        while end < len(plain) and plain[end].lstrip().startswith("|"):
            end += 1
        cells = [cell.strip().strip("*") for row in plain[i + 1:end] for cell in row.split("|")[2:]]
        measured = bool(MEASURED_HEADER.search(plain[i])) or any(UNIT.fullmatch(cell) for cell in cells)
        found.update({row: (i, measured) for row in range(i + 2, end) if not ROW_RULE.match(plain[row])})
        i = end
    return found


def figures_in(text: str) -> dict[int, list[str]]:
    """The figures of `text`, by line number (0-based)."""
    lines = text.splitlines()
    plain = prose(text).splitlines()
    rows = tables(plain)
    headers = {header for header, _ in rows.values()}
    found: dict[int, list[str]] = {}
    for i, line in enumerate(plain):
        if EXEMPT.search(lines[i]) or i in headers:
            continue
        if i in rows:  # a row: its first cell names it, the others hold its values
            header, measured = rows[i]
            if not measured or (header and EXEMPT.search(lines[header - 1])):
                continue
            start = line.find("|", line.find("|") + 1)
            matches = [m for pattern in (UNIT, DECIMAL, TABLE_NUMBER) for m in pattern.finditer(line, start)]
        else:
            before = (plain[i - 1] if i else "") + " "
            matches = [m for pattern in (UNIT, DECIMAL) for m in pattern.finditer(line)
                       if not NOT_A_FIGURE.search(before + line[:m.start()])]
        hits, taken = [], set()
        for m in sorted(matches, key=lambda m: (m.start(), -m.end())):  # the longest reading of each
            if not taken & set(range(*m.span())):
                hits.append(m.group(0).strip())
                taken |= set(range(*m.span()))
        if hits:
            found[i] = list(dict.fromkeys(hits))
    return found


def unnamed(path: Path, text: str | None = None) -> list[Figure]:
    """The figures of a page whose section names no results file."""
    text = path.read_text() if text is None else text
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    lines = text.splitlines()
    figures = figures_in(text)
    heads = sections(text)
    out = []
    for line, hits in sorted(figures.items()):
        title, start, end = max((s for s in heads if s[1] <= line < s[2]), key=lambda s: s[1])
        if results_files("\n".join(lines[start:end])):
            continue
        out.append(Figure(name, line + 1, title, ", ".join(hits)))
    return out


def without_files() -> list[Figure]:
    return [figure for path in PAGES for figure in unnamed(path)]


def test_every_figure_names_its_results_file_beside_it():
    missing = [f for f in without_files() if (f.file, f.heading) not in KNOWN]
    assert missing == [], "figures whose section names no results file:\n" + "\n".join(map(str, missing))


def test_each_known_exception_is_still_needed():
    left = {(f.file, f.heading) for f in without_files()}
    assert set(KNOWN) <= left, f"KNOWN lists sections that now name their file: {sorted(set(KNOWN) - left)}"


PAGE = ROOT / "docs" / "page.md"


@pytest.mark.parametrize("text", [
    "# Page\n\n## Speed\n\nThe engine made 141.7 tok/s.\n",
    "# Page\n\n## Time\n\nIt took 13.8 s, about 1.8% of a run.\n",
    "# Page\n\n## Table\n\n| arm | time (s) |\n| --- | ---: |\n| sync | 111.5 |\n",
    "# Page\n\n## Table\n\n| shape | trained | peak |\n| --- | --- | ---: |\n| 0.5B | full | 7.47 GiB |\n",
    "# Page\n\n## Pass\n\nThe tuned model passed 0.719 of the prompts.\n",
    "# Page\n\n## Steps\n\nOne seed took 85 steps to 0.75.\n",
    "# Page\n\n## A\n\nIt took 2.4x as long.\n\n## B\n\n`bench/results/h100/train_step.json`\n",
    "# Page\n\nIt took 2.4x as long.\n\n## B\n\n`bench/results/h100/train_step.json`\n",
    "# Page\n\n## A\n\n### A.1\n\nIt took 2.4x as long.\n\n## B\n\n`bench/results/h100/train_step.json`\n",
])
def test_a_figure_without_a_results_file_in_its_section_fails(text):
    assert unnamed(PAGE, text), text


@pytest.mark.parametrize("text", [
    "# Page\n\n## Speed\n\nThe engine made 141.7 tok/s (`bench/results/epyc-2core/rollout_throughput.json`).\n",
    "# Page\n\n## Speed\n\n141.7 tok/s.\n\n### Detail\n\n[numbers](../results/epyc-2core/rollout_throughput.json)\n",
    "# Page\n\n## Table\n\n| arm | time (s) |\n| --- | ---: |\n| sync | 111.5 |\n\n"
    "Results: `bench/results/h100/time_to_threshold.json`.\n",
])
def test_a_figure_with_a_results_file_in_its_section_passes(text):
    assert unnamed(PAGE, text) == [], text


@pytest.mark.parametrize("text", [
    "# Page\n\n## Code\n\n```\npython bench/x.py  # 141.7 tok/s, 13.8 s, 2x\n```\n",
    "# Page\n\n## Code\n\n~~~\n13.8 s\n```\n0.719\n~~~\n",
    "# Page\n\n## Span\n\nRun `--set run.max_wall_s=60` or `sleep 5s`, or ``` `13.8 s` ```.\n",
    "# Page\n\n## Limit\n\nAn eval in flight is finished (at\nmost 60 s); a checkpoint every 50 steps.\n",
    "# Page\n\n## Limit\n\nA process holds up to its limit x 1 GiB, within the stop's bound (60 s).\n",
    "# Page\n\n## Device\n\nIt fits a 24 GB GPU, not an H100 80GB; a few 410s at the end.\n",
    "# Page\n\n## Counts\n\n| mode | staleness bound | interruptible |\n| --- | --- | --- |\n| areal | 4 | on |\n",
    "# Page\n\n## Quoted\n\nThe paper reports 3.2x. <!-- figure: not ours (the paper's Table 2) -->\n",
    "# Page\n\n## Quoted\n\n<!-- figure: not ours (upstream's README) -->\n| arm | time (s) |\n"
    "| --- | ---: |\n| sync | 111.5 |\n",
])
def test_code_settings_counts_and_exempted_numbers_are_not_figures(text):
    assert unnamed(PAGE, text) == [], text


def test_a_results_file_that_does_not_exist_does_not_count():
    text = "# Page\n\n## Speed\n\n141.7 tok/s (`bench/results/epyc-2core/no_such_bench.json`).\n"
    assert unnamed(PAGE, text)
