"""The docs name every recipe field and every shipped recipe, and the README's usage lines the
options that say where the data is."""
import argparse
import re
from pathlib import Path

from pydantic import BaseModel

from speedrun.cli import build_parser
from speedrun.recipe import Recipe, shipped_recipes

ROOT = Path(__file__).resolve().parents[1]


def field_paths(model: type[BaseModel], prefix: str = ""):
    for name, f in model.model_fields.items():
        options = getattr(f.annotation, "__args__", (f.annotation,))
        nested = [o for o in options if isinstance(o, type) and issubclass(o, BaseModel)]
        if nested:
            for n in nested:
                yield from field_paths(n, f"{prefix}{name}.")
        else:
            yield prefix + name


def test_every_recipe_field_is_documented():
    text = (ROOT / "docs" / "recipes.md").read_text()
    missing = sorted(p for p in set(field_paths(Recipe)) if f"`{p}`" not in text)
    assert not missing, f"undocumented recipe fields: {missing}"


def test_every_shipped_recipe_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in shipped_recipes())


def _commands_taking(option: str, parser=None, prefix: str = ""):
    """'train', 'data export', ...: every command of the real parser that takes ``option``."""
    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if option in sub._option_string_actions:
                    yield prefix + name
                yield from _commands_taking(option, sub, f"{prefix}{name} ")


def test_the_readme_usage_lines_show_data_dir_for_every_command_that_takes_it():
    block = (ROOT / "README.md").read_text().split("## Commands", 1)[1].split("```")[1]
    entries, current = [], None
    for line in block.splitlines():
        if line.startswith("speedrun "):
            current = [line]
            entries.append(current)
        elif line.startswith(" ") and current is not None:
            current.append(line)
    commands = sorted(_commands_taking("--data-dir"))
    assert {"train", "flops", "export", "evaluate", "data export"} <= set(commands)
    for command in commands:
        usage = [" ".join(e) for e in entries if e[0].startswith(f"speedrun {command} ")]
        assert usage, f"no usage line for speedrun {command}"
        # "[...]" stands for train's options (bench)
        assert any("--data-dir" in u or "[...]" in u for u in usage), f"speedrun {command}: {usage}"


def _results_page():
    """scripts/results_page.py as a module (scripts/ is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "scripts" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_results_md_is_current_names_every_record_and_has_no_placeholders():
    import re
    import pytest
    expected = _results_page().render()
    page = ROOT / "docs" / "results.md"
    if not page.is_file() or page.read_text(encoding="utf-8") != expected:
        pytest.fail("docs/results.md is not what scripts/results_page.py writes from benchmarks/results/: "
                    "run `python scripts/results_page.py` (after adding or changing a record) and commit the page",
                    pytrace=False)
    results = ROOT / "benchmarks" / "results"
    records = [p for p in results.iterdir() if p.is_file()]
    records += [p for d in results.iterdir() if d.is_dir() for p in d.rglob("*.json")]
    names = sorted(p.relative_to(results).as_posix() for p in records)
    missing = [n for n in names if f"`{n}`" not in expected]
    assert not missing, f"records not named in docs/results.md: {missing}"
    cells = [c.strip() for line in expected.splitlines() if line.startswith("|")
             for c in line.strip().strip("|").split(" | ")]
    placeholder = re.compile(r"[A-Z0-9_]*[A-Z][A-Z0-9_]*_[A-Z0-9_]*|X{2,}|\?+|")     # ZEN5_20, XX, ?, empty
    bad = [c for c in cells if placeholder.fullmatch(c) or re.search(r"\b(TODO|TBD|FIXME|XXX?)\b", c)]
    assert not bad, f"placeholder-like cells in docs/results.md: {bad}"


def test_results_page_lists_records_it_cannot_read_under_other(tmp_path):
    (tmp_path / "a-new-kind.json").write_text('{"benchmark": "a new kind of measurement", "figures": [1]}')
    (tmp_path / "cut-short.json").write_text('{"benchmark": "speedrun train, whole pro')
    (tmp_path / "speedrun-train-no-runs.json").write_text('{"benchmark": "speedrun train, whole process"}')
    page = _results_page().render(tmp_path)
    other = page.split("## Other records", 1)[1]
    for name in ("a-new-kind.json", "cut-short.json", "speedrun-train-no-runs.json"):
        assert f"`{name}`" in other
    assert "a new kind of measurement" in other
    assert _results_page().render(tmp_path) == page                  # the same bytes every time


def test_the_readme_demo_names_the_cpu_of_every_time_and_says_how_to_vary_the_seed():
    section = (ROOT / "README.md").read_text().split("## Install and run", 1)[1].split("Run the tests", 1)[0]
    assert "seed" in section and "fixed at 0" in section and "`--seed N`" in section
    blocks = [b for b in re.split(r"\n\s*\n|\n- ", section) if re.search(r"\d s\b", b)]
    assert blocks
    for block in blocks:                      # a time is given with the CPU that measured it
        assert re.search(r"Intel Xeon|AMD (EPYC )?Zen", block), block
    assert "expect" not in section            # no promise of how long it takes on the reader's CPU


def test_results_page_reads_the_throughput_records_into_their_tables(tmp_path):
    import shutil
    src = ROOT / "benchmarks" / "results" / "gpu-h200-2026-11-26-1fab1ca"
    for name in ("imagenet-throughput-resnet50.json", "photo-throughput-imagenette.json"):
        shutil.copy(src / name, tmp_path / name)
    page = _results_page().render(tmp_path)
    assert "## Other records" not in page
    resnet = page.split("## ResNet-50 training throughput", 1)[1]
    assert "`imagenet-throughput-resnet50.json`" in resnet and "6,576" in resnet and "pipeline" in resnet
    photo = page.split("## Photo input pipelines", 1)[1].split("\n## ", 1)[0]
    assert "`photo-throughput-imagenette.json`" in photo and "3,331" in photo and "model" in photo


def test_results_page_reads_the_accuracy_sweeps_a_row_per_variant(tmp_path):
    import shutil
    src = ROOT / "benchmarks" / "results" / "gpu-h200-2026-11-27-e9be504"
    shutil.copy(src / "imagenette-sweep-1-antialias-eval-size-batch.json", tmp_path / "sweep.json")
    page = _results_page().render(tmp_path)
    assert "## Other records" not in page
    table = page.split("## Imagenette", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `sweep.json`")]
    assert len(rows) == 8                                   # one per variant
    base = next(r for r in rows if "base: `imagenette` as at e9be504" in r)
    assert "86.22%" in base and "NVIDIA H200" in base
    stem = next(r for r in rows if "stem: `imagenette` model.antialias=stem" in r)
    assert "+0.22 against base" in stem                     # Welch against the first variant of its recipe
    base20 = next(r for r in rows if r.startswith("| `sweep.json` | base20"))
    assert "against stem20" in base20 and "91.71%" in base20


def test_results_page_names_each_script_that_left_benchmarks_and_how_to_get_it_back(tmp_path):
    import shutil
    import subprocess
    import pytest
    shutil.copy(ROOT / "benchmarks" / "results" / "tta-views-scales-amd-epyc-26-2-e9a85e1.json", tmp_path / "tta.json")
    (tmp_path / "one-off.json").write_text(
        '{"what": "a one-off", "command": "gone_away.py --out x.json", "environment": {"git_commit": "abc1234def"}}')
    (tmp_path / "kept.json").write_text('{"what": "another one-off", "command": "benchmarks/train_cli.py x"}')
    page = _results_page().render(tmp_path)
    gone = page.split("## Records whose script left the tree", 1)[1]
    rows = {line.split(" | ")[0]: line for line in gone.splitlines() if line.startswith("| `")}
    assert "`one-off.json` (abc1234)" in rows["| `gone_away.py`"]            # named by a record no kind reads
    assert "`tta.json` (b1f09d7 (dirty))" in rows["| `tta_views.py`"]         # the script of the record's kind
    assert not any("train_cli" in name or "kept.json" in line for name, line in rows.items())
    command = re.search(r"`(git show [^`]*tta_views\.py)`", rows["| `tta_views.py`"]).group(1)
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a git checkout with its whole history: the command that gets the script back reads it")
    got = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True)
    assert got.returncode == 0 and "def main" in got.stdout, got.stderr          # the script as it was when it left


USER_DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_and_the_speed_guide_stay_short():
    for path, most in ((ROOT / "README.md", 300), (ROOT / "docs" / "speed.md", 300)):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        assert lines <= most, f"{path.relative_to(ROOT)} has {lines} lines, more than {most}"


def test_no_issue_numbers_or_work_notes_where_a_user_reads():
    """README, docs, benchmarks/README.md and everything under src/ (help strings, recipe comments)."""
    files = USER_DOCS + [p for p in (ROOT / "src").rglob("*") if p.is_file() and p.suffix in {".py", ".toml", ".md", ".txt"}]
    pattern = re.compile(r"issue [0-9]+|\bacceptance\b|\bTODO\b|\bTBD\b|\bFIXME\b", re.IGNORECASE)
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in files
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings: lower case, punctuation dropped, spaces to hyphens."""
    seen, anchors, fenced = {}, set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.+)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_links_between_the_docs_reach_a_file_and_a_heading():
    broken = []
    for page in USER_DOCS:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue                                        # http(s), mailto: not checked here
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_results_page_marks_a_warm_up_calls_side_by_side_times_as_not_comparable(tmp_path):
    """A --synthetic gpu_record.py call with --jobs K ran K processes on one machine's CPU (a lending's
    compile warm-up): each of its rows says so, and a call of one process at a time says nothing of it."""
    import json
    record = ROOT / "benchmarks" / "results" / "gpu-h200-2026-12-04-f0da464" / "call1-gpu-record-synthetic.json"
    data = json.loads(record.read_text())
    assert data["mode"] == "synthetic" and data["jobs"] == 5 and len(data["variants"]) == 8
    (tmp_path / "warm-up.json").write_text(json.dumps(data))
    (tmp_path / "alone.json").write_text(json.dumps({**data, "jobs": 1}))
    page = _results_page().render(tmp_path)
    rows = {name: [line for line in page.splitlines() if line.startswith(f"| `{name}.json` |")]
            for name in ("warm-up", "alone")}
    assert len(rows["warm-up"]) == len(rows["alone"]) == 8
    says = "5 processes side by side: a compile warm-up, its times not comparable"
    assert all(says in line for line in rows["warm-up"]) and not any("side by side" in line for line in rows["alone"])
