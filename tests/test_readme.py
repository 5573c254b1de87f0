"""The user-facing pages: README's budget, no run-diary words, headline numbers from results.

README.md is the front door: at most :data:`README_BUDGET` lines. The pages a
user reads (README.md, SERIES.md, docs/, and the opening section of every
results README, before its first ``## `` heading) use no words of the
project's own run diary (:data:`DIARY`). Every decode, memory or hit-rate
number in README's prose must be one that the e2e summary (``document.E2E_SUMMARY``) gives
(its generated tables), and the generated "Which flag" table must be current. The install
command of README's "Use it" and docs/serving.md is the one the harness runs.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from harness import document, e2e, venv
from harness.project import Project

ROOT = Path(__file__).resolve().parent.parent
README_BUDGET = 150

#: Words of the project's run diary, which mean nothing to a reader of the pages.
DIARY = re.compile(
    r"\bsessions?\b|\b(?:device )?call \d+|\bcalls? \d+(?:-\d+)?\b|\bthis round\b"
    r"|\bmachine starts?\b|\bto-?do\b",
    re.I,
)
#: A number with a unit README's prose may only take from the e2e results.
HEADLINE = re.compile(r"(\d[\d,]*(?:\.\d+)?)\s*(tok/s|tokens/s|GiB|%)")


def user_pages(root: Path) -> dict[str, str]:
    """Each user page's text, results READMEs cut to their opening section, code
    blocks removed (program output is quoted, not written)."""
    pages = {name: (root / name).read_text() for name in ("README.md", "SERIES.md")}
    pages |= {str(p.relative_to(root)): p.read_text() for p in sorted(root.glob("docs/*.md"))}
    for path in sorted(root.glob("results/**/README.md")):
        text = path.read_text()
        heading = re.search(r"^## ", text, re.M)
        pages[str(path.relative_to(root))] = text[: heading.start()] if heading else text
    return {name: strip_code(text) for name, text in pages.items()}


def strip_code(text: str) -> str:
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return "\n".join(line for line in text.splitlines() if not line.startswith("    "))


def diary_words(pages: dict[str, str]) -> list[str]:
    return [
        f"{name}: {match.group(0)!r}"
        for name, text in pages.items()
        for match in DIARY.finditer(text)
    ]


def prose_headlines(readme: str) -> list[str]:
    """README's headline numbers outside its generated blocks and code."""
    prose = re.sub(
        r"<!-- BEGIN GENERATED: .*?<!-- END GENERATED: [\w-]+ -->", "", readme, flags=re.S
    )
    return [m.group(1) for m in HEADLINE.finditer(strip_code(prose))]


def summary_numbers(root: Path) -> set[str]:
    """Every number the e2e summary's generated tables show (README's table and its
    conditions, matrix.md)."""
    summary = json.loads((root / document.E2E_SUMMARY).read_text())
    text = document.render_which_flag(Project.discover(root, env={})) + e2e.matrix_markdown(summary)
    return set(re.findall(r"\d[\d,]*(?:\.\d+)?", text))


def test_readme_is_within_its_budget():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_BUDGET, f"README.md has {len(lines)} lines, budget {README_BUDGET}"


def test_readme_front_matter_comes_first():
    """The review commands, the upstream status, the flag and the Which-flag table sit in
    the first 40 lines."""
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    for needle in ("nox -s apply build test", "#56177", "--moe-expert-pool-rows", "| flag |"):
        assert needle in head, needle


def test_user_pages_have_no_diary_words():
    assert diary_words(user_pages(ROOT)) == []


def test_diary_check_catches_a_diary_word(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "results/x").mkdir(parents=True)
    (tmp_path / "README.md").write_text("# r\n\nMeasured in session 7.\n")
    (tmp_path / "SERIES.md").write_text("```\ncall 3 in a code block is output\n```\n")
    (tmp_path / "docs/a.md").write_text("ran on one machine start\n")
    (tmp_path / "results/x/README.md").write_text("# x\n\nok\n\n## Log\n\ncall 2 below\n")
    found = diary_words(user_pages(tmp_path))
    assert found == ["README.md: 'session'", "docs/a.md: 'machine start'"]


def test_readme_which_flag_table_is_current():
    project = Project.discover(ROOT, env={})
    text = (ROOT / "README.md").read_text()
    assert "<!-- BEGIN GENERATED: which-flag -->" in text
    assert document.render(project, text) == text, "run `python -m harness doc`"


def test_readme_headline_numbers_come_from_the_e2e_summary():
    numbers = summary_numbers(ROOT)
    readme = (ROOT / "README.md").read_text()
    assert prose_headlines(readme), "README quotes no headline number: check the pattern"
    assert [n for n in prose_headlines(readme) if n not in numbers] == []


@pytest.mark.parametrize("typed", ["52.4 tok/s", "12.3 GiB", "69.8%"])
def test_a_number_typed_by_hand_is_caught(typed):
    readme = (ROOT / "README.md").read_text() + f"\nThe pool reached {typed}.\n"
    assert typed.split()[0].rstrip("%") in [
        n for n in prose_headlines(readme) if n not in summary_numbers(ROOT)
    ]


def openings_without_headline(root: Path) -> list[str]:
    """Results READMEs (results/ and each folder in it) whose opening section, before the
    first ``## `` heading, lacks a table or a line naming the conditions or the GPU."""
    missing = []
    for path in [root / "results/README.md", *sorted(root.glob("results/*/README.md"))]:
        text = path.read_text()
        heading = re.search(r"^## ", text, re.M)
        opening = text[: heading.start()] if heading else text
        if "| --- |" not in opening or not re.search(r"Conditions|H200", opening):
            missing.append(str(path.relative_to(root)))
    return missing


def test_results_readmes_open_with_their_headline_table():
    assert openings_without_headline(ROOT) == []


def test_an_opening_without_a_table_is_caught(tmp_path):
    (tmp_path / "results/a").mkdir(parents=True)
    (tmp_path / "results/README.md").write_text("# R\n\n| x |\n| --- |\n\nConditions: H200\n")
    (tmp_path / "results/a/README.md").write_text("# A\n\n## Run 1\n\n| x |\n| --- |\n")
    assert openings_without_headline(tmp_path) == ["results/a/README.md"]


# --- the user guide and its copy in the series -------------------------------------------


def test_guide_drift_compares_the_page_with_the_trees_copy(project):
    guide = project.root / document.GUIDE
    guide.parent.mkdir(parents=True, exist_ok=True)
    page = "# Pool\n\nUse it.\n"
    guide.write_text(page + f"\n{document.GUIDE_PROJECT_ONLY}\n\nProject notes.\n")
    assert document.guide_drift(project) == []  # the tree has no copy yet
    copy = project.tree / document.GUIDE_IN_TREE
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(page)
    assert document.guide_drift(project) == []  # the project-only tail is not compared
    copy.write_text(page.replace("Use it.", "Use it often."))
    assert document.guide_drift(project) == [
        f"{document.GUIDE} and the tree's {document.GUIDE_IN_TREE} differ from line 3: copy "
        f"the page into the series' guide commit (everything above "
        f"{document.GUIDE_PROJECT_ONLY!r}) or bring the change back"
    ]
    copy.write_text(page + "More.\n")
    assert document.guide_drift(project) != []


def test_the_guide_is_a_vllm_page_above_its_project_only_part():
    """The part meant for vLLM links to no file of this project and has vLLM's sections."""
    page = document.guide_for_vllm((ROOT / document.GUIDE).read_text())
    assert document.GUIDE_PROJECT_ONLY in (ROOT / document.GUIDE).read_text()
    assert re.findall(r"\]\((?!#|https?://)[^)]*\)", page) == []
    assert not re.search(r"results/|harness|\bseed\b", page)
    headings = re.findall(r"^## (.+)$", page, re.M)
    order = ["When to use it", "Requirements", "Enabling the expert pool", "Sizing", "Metrics",
             "Limitations"]  # fmt: skip
    assert [h for h in headings if h in order] == order
    assert "vllm serve" in page and "LLM(" in page


def test_the_conditions_line_names_the_attention_backend_as_users_know_it():
    assert document.attention_name("FLASH_ATTN (FA3)") == "FlashAttention 3"
    assert document.attention_name("FLASH_ATTN") == "FlashAttention"
    assert document.attention_name("TRITON_ATTN") == "Triton attention"
    assert document.attention_name("FLASHINFER") == "FLASHINFER"  # unknown: as recorded


# --- the serving path: README's "Use it" and docs/serving.md ------------------------------------


def serving_install(project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The line the serving pages give for what :func:`harness.venv.install` runs: the wheel
    from ``dist/LATEST`` and the same requirements, each override in a ``--override``."""
    commands: list[list[str]] = []
    monkeypatch.setattr(venv, "run", lambda cmd, **kwargs: commands.append(list(map(str, cmd))))
    venv.install(project, tmp_path / "bin" / "python", "WHEEL")
    (cmd,) = commands
    requirements = cmd[cmd.index("WHEEL") + 1 :]
    if "--override" in requirements:
        requirements = requirements[: requirements.index("--override")]
    overrides = (tmp_path / "overrides.txt").read_text().split()
    return " ".join(
        ["uv pip install", '"$(cat .work/dist/LATEST)"', *map(shlex.quote, requirements)]
        + [f"--override <(echo {shlex.quote(req)})" for req in overrides]
    )


@pytest.mark.parametrize("page", ["README.md", "docs/serving.md"])
def test_the_serving_pages_install_what_the_harness_installs(page, tmp_path, monkeypatch):
    project = Project.discover(ROOT, env={})
    lines = (ROOT / page).read_text().splitlines()
    assert serving_install(project, tmp_path, monkeypatch) in lines
    venv_line = (
        f"uv venv --python {project.pin.python} ~/vllm-series && . ~/vllm-series/bin/activate"
    )
    assert venv_line in lines
