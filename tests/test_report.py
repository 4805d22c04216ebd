"""Reports rendered for real in headless Chromium: every image loads, key figures are shown."""
import json
import re
import shutil
import subprocess

import pytest

from speedrun.cli import main
from test_cli import speedrun

CHECK_SCRIPT = """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.setAttribute('data-images', ok + '/' + imgs.length);
});
</script></body>"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("headless Chromium is not installed here (Debian: apt-get install chromium; .ci/run "
                "installs it); the report's rendering check cannot run")


def render(html_path, tmp_path) -> str:
    """The DOM after load, with a script counting images that decoded."""
    page = tmp_path / "checked.html"
    page.write_text(html_path.read_text().replace("</body>", CHECK_SCRIPT))
    proc = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
                           "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def images_loaded(dom: str) -> tuple[int, int]:
    m = re.search(r'data-images="(\d+)/(\d+)"', dom)
    assert m, "the page's load handler did not run"
    return int(m.group(1)), int(m.group(2))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, fashion_small):
    out = tmp_path_factory.mktemp("rep") / "run"
    speedrun("train", "fashion-mnist", "--data-dir", fashion_small, "--set", "data.dataset=npz", "--out", out,
             "--set", "train.epochs=2", "--set", "model.widths=[8,16,16]", "--set", "data.batch_size=256")
    return out


def test_run_report_renders_with_all_images(run_dir, tmp_path):
    proc = speedrun("report", run_dir)
    html, md = run_dir / "report.html", run_dir / "report.md"
    assert "report.html" in proc.stdout and md.is_file()
    dom = render(html, tmp_path)
    ok, total = images_loaded(dom)
    assert total == 2 and ok == total                       # training curves + schedule
    summary = json.loads((run_dir / "summary.json").read_text())
    assert f"{summary['test_acc']:.2%}" in dom and "fashion-mnist" in dom and summary["device_name"] in dom
    for name in re.findall(r"\]\((report_files/[^)]+)\)", md.read_text()):
        assert (run_dir / name).read_bytes()[:4] == b"\x89PNG"


def test_bench_and_ablate_reports_render(bench_records, tmp_path):
    root = bench_records[0]
    speedrun("report", root / "a")
    dom = render(root / "a" / "report.html", tmp_path)
    ok, total = images_loaded(dom)
    assert total == 4 and ok == total                       # histogram, times, curves, schedule
    rec = json.loads((root / "a" / "bench.json").read_text())
    assert f"{rec['summary']['test_acc']['mean'] * 100:.3f}" in dom and "p-value" in dom

    speedrun("report", root / "abl")
    dom = render(root / "abl" / "report.html", tmp_path)
    assert images_loaded(dom) == (1, 1) and "without tta" in dom


def test_report_of_a_folder_without_records_says_so(tmp_path):
    proc = speedrun("report", tmp_path, check=False)
    assert proc.returncode == 1 and "no summary.json, bench.json or ablate.json" in proc.stderr


def test_run_report_shows_the_evaluation(run_dir, tmp_path):
    """`speedrun evaluate` on an array-data run reproduces its accuracy exactly, and the report
    gains the per-class table, the confusion matrix and the mistakes grid."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns("report*"))
    proc = speedrun("evaluate", run, "--device", "cpu")
    assert "equal to the record" in proc.stdout and "yes, exactly" in proc.stdout
    summary, evaluation = (json.loads((run / n).read_text()) for n in ("summary.json", "evaluation.json"))
    assert (evaluation["test_acc"], evaluation["test_acc_no_tta"]) == (summary["test_acc"], summary["test_acc_no_tta"])
    assert main(["report", str(run)]) == 0
    dom = render(run / "report.html", tmp_path)
    assert images_loaded(dom) == (4, 4)                     # curves, schedule, confusion matrix, mistakes
    for text in ("per class (with TTA)", "confusion matrix (rows: true class", "Ankle boot", "yes, exactly",
                 'id="fig-confusion"', 'id="fig-mistakes"'):
        assert text in dom, text
    assert "report_files/confusion.png" in (run / "report.md").read_text()
