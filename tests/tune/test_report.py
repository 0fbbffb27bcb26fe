"""The job report: exact hypervolume, and a self-contained HTML page with readable PNGs for a
finished study in the current layout (tests/tune/studies.py) and for the real GPU study shipped
in docs/results (older layout: numbers nested in a ``metrics`` attr)."""

from __future__ import annotations

import base64
import hashlib
import itertools
import shutil
import struct
from html.parser import HTMLParser
from pathlib import Path

import optuna
import pytest
from PIL import Image

from erase_tune.errors import EraseTuneError
from erase_tune.tune.views.html_report import ReportFiles, report, write_report
from erase_tune.tune.views.report_data import front_within_budget, read_records
from erase_tune.tune.search.hypervolume import hypervolume, hypervolume_history
from tests.tune.conftest import ROOT
from tests.tune.studies import FRONT, MAX_NE_GAP, MEASURED, STUDY_NAME, write_finished_study

SHIPPED = ROOT / "docs" / "results" / "tune_ctr_h200x2.db"
SHIPPED_FRONT = [14, 21, 17, 20]  # docs/results/tune_ctr_h200x2_status.txt, written by `status` on the GPU


@pytest.fixture(autouse=True)
def _quiet_optuna():
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    yield
    optuna.logging.set_verbosity(verbosity)


# -- hypervolume -------------------------------------------------------------------------------


@pytest.mark.parametrize("points, expected", [
    ([], 0.0),
    ([(0.5, 0.01)], 0.5 * 0.01),                                   # one rectangle up to the budget
    ([(0.5, -0.01)], 0.5 * 0.03),                                  # a negative gap (better NE) counts below 0
    ([(0.8, 0.01), (0.5, 0.0)], 0.8 * 0.01 + 0.5 * 0.01),          # two steps: union, not sum
    ([(0.8, 0.01), (0.5, 0.0), (0.4, 0.005)], 0.013),              # a dominated point adds nothing
    ([(0.8, 0.01), (0.8, 0.01)], 0.008),                           # nor does a repeat
    ([(0.9, 0.015), (0.6, 0.005), (0.3, -0.005)], 0.9 * 0.005 + 0.6 * 0.01 + 0.3 * 0.01),
    ([(0.0, 0.0), (-0.2, -0.01)], 0.0),                            # no faster than the baseline
    ([(0.9, 0.02), (0.9, 0.05)], 0.0),                             # at or over the budget
    ([(0.9, 0.05), (0.1, 0.0)], 0.1 * 0.02),                       # the infeasible one hides nothing
])
def test_hypervolume_matches_hand_computed_areas(points, expected):
    assert hypervolume(points, 0.02) == pytest.approx(expected, abs=1e-15)
    assert hypervolume(list(reversed(points)), 0.02) == pytest.approx(expected, abs=1e-15)


def test_hypervolume_history_is_per_trial_and_keeps_failed_trials_in_place():
    trials = [(0.5, 0.01), None, (0.2, 0.0), (0.6, 0.03), (0.8, 0.01)]
    # (0.2, 0) adds the strip below 0.01; (0.6, 0.03) is over the budget; (0.8, 0.01) widens the top
    assert hypervolume_history(trials, 0.02) == pytest.approx([0.005, 0.005, 0.007, 0.007, 0.010], abs=1e-15)
    assert hypervolume_history([], 0.02) == []


def test_hypervolume_refuses_non_finite_input():
    with pytest.raises(ValueError, match="not finite"):
        hypervolume([(float("nan"), 0.0)], 0.02)
    with pytest.raises(ValueError, match="not finite"):
        hypervolume([(0.5, 0.0)], float("inf"))


# -- reading the page back -------------------------------------------------------------------


class _Page(HTMLParser):
    """Every attribute that loads something, every tag, the text, and the tables as rows of cells."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.tags: set[str] = set()
        self.text: list[str] = []
        self.tables: list[list[list[str]]] = []
        self.images: list[str] = []
        self._cell: list[str] | None = None
        self._style = False
        self.style = ""

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        for name, value in attrs:
            if name in ("src", "href", "srcset", "poster", "data", "action", "background"):
                self.links.append(value or "")
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []
        self._style = tag == "style"

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None
        self._style = False

    def handle_data(self, data):
        if self._style:
            self.style += data
            return
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)

    def table(self, first_header: str, second_header: str) -> list[list[str]]:
        """The body rows of the table whose header starts with these two cells."""
        (found,) = [t for t in self.tables if t and t[0][:2] == [first_header, second_header]]
        return found[1:]


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _png_size_and_chunks(data: bytes) -> tuple[int, int, list[tuple[bytes, bytes]]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    chunks, pos = [], 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        chunks.append((data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]))
        pos += 12 + length
    width, height = struct.unpack(">II", chunks[0][1][:8])
    return width, height, chunks


def _check_files(files: ReportFiles) -> _Page:
    assert files.html.is_file()
    for png in files.pngs:
        data = png.read_bytes()
        width, height, chunks = _png_size_and_chunks(data)
        assert 500 <= width <= 2500 and 250 <= height <= 2000, (png.name, width, height)
        with Image.open(png) as im:  # a full decoder, not just a header check
            im.verify()
        # deterministic: no time chunk, no text chunk naming the software or a date
        assert all(kind not in (b"tIME", b"tEXt", b"iTXt", b"zTXt") for kind, _ in chunks), png.name
    page = _parse(files.html)
    # self-contained: whatever loads something is a data: URI; no scripts, stylesheets or frames
    assert page.links and all(link.startswith("data:") for link in page.links), page.links
    assert not page.tags & {"script", "link", "iframe", "object", "embed", "base"}
    assert "url(" not in page.style and "@import" not in page.style
    # the embedded figures are the PNG files written beside the page
    embedded = {base64.b64decode(src.split(",", 1)[1]) for src in page.images}
    assert embedded == {p.read_bytes() for p in files.pngs}
    text = " ".join(page.text)
    assert "qps_gain" in text and "ne_gap" in text
    return page


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> str:
    return write_finished_study(tmp_path_factory.mktemp("study") / "finished.db")


def test_report_of_a_finished_study(finished, tmp_path):
    files = report(finished, None, tmp_path / "out")  # the directory is created
    assert files.html.parent == tmp_path / "out" and files.importance is not None
    page = _check_files(files)

    front = page.table("trial", "qps_gain")
    assert [int(row[0]) for row in front] == FRONT  # largest gain first; the repeat of trial 7 is not there
    # the objective is over the graph baseline here; both gains are listed, as percentages
    assert front[0][1] == "+50.40%" and front[0][2] == "+1.90%" and front[0][3] == "+88.00%"
    assert front[0][4] == "+50.40%"

    facts = dict(page.table("fact", "value"))
    assert facts["NE budget (max_ne_gap)"] == "2.00%"
    assert facts["qps_gain is over"] == "the graph baseline"
    assert facts["trials by state"] == "16 complete, 2 fail"
    assert facts["measured plans"] == f"{len(MEASURED)} (11 within the NE budget)"
    assert facts["repeats of a measured plan"].startswith("1 ")
    assert "paper #1: +28.00% at NE gap +7.36%, over the budget" in facts["seeds (plans the job measured first)"]

    failures = page.table("trial", "kind")
    assert [(r[0], r[1]) for r in failures] == [("9", "trial"), ("11", "infra")]
    assert "CUDA out of memory" in failures[0][2] and "node 127.0.0.1 lost" in failures[1][2]


def test_hypervolume_history_of_the_study_is_non_decreasing_and_matches_the_front(finished):
    study = optuna.load_study(study_name=STUDY_NAME, storage=finished)
    records = read_records(study)
    history = hypervolume_history([(r.qps_gain, r.ne_gap) if r.measured else None for r in records], MAX_NE_GAP)
    assert len(history) == len(records)
    assert all(b >= a for a, b in itertools.pairwise(history))
    front = front_within_budget(records)
    assert history[-1] == pytest.approx(hypervolume([(p.qps_gain, p.ne_gap) for p in front], MAX_NE_GAP))
    assert history[-1] > 0


def test_a_regenerated_report_is_byte_identical(finished, tmp_path):
    study = optuna.load_study(study_name=STUDY_NAME, storage=finished)
    a, b = write_report(study, tmp_path / "a"), write_report(study, tmp_path / "b")
    for x, y in zip((a.html, *a.pngs), (b.html, *b.pngs), strict=True):
        assert x.name == y.name and x.read_bytes() == y.read_bytes(), x.name


def test_report_of_the_shipped_gpu_study(tmp_path):
    """The real 24-trial H200 job, in the older layout (metrics nested in one attr)."""
    db = tmp_path / "tune_ctr_h200x2.db"
    shutil.copyfile(SHIPPED, db)  # never open the shipped file itself: Optuna may write to a storage it opens
    shipped_hash = hashlib.sha256(SHIPPED.read_bytes()).hexdigest()
    files = report(f"sqlite:///{db}", None, tmp_path / "out")
    page = _check_files(files)
    front = page.table("trial", "qps_gain")
    assert [int(row[0]) for row in front] == SHIPPED_FRONT
    # the legacy names are mapped: gain over eager (gain_p90) and over the graph baseline (gain_vs_reference)
    assert front[1][:5] == ["21", "+92.70%", "-0.51%", "+92.70%", "+8.40%"]
    facts = dict(page.table("fact", "value"))
    assert facts["qps_gain is over"] == "the eager baseline"  # the older study has no gain_over: eager
    assert facts["trials by state"] == "24 complete"
    assert facts["workload"].startswith("ctr ")
    assert "PED-ANOVA over 24 measured trials" in " ".join(page.text)
    assert hashlib.sha256(SHIPPED.read_bytes()).hexdigest() == shipped_hash

    records = {r.number: r for r in read_records(optuna.load_study(study_name="gpu", storage=f"sqlite:///{db}"))}
    assert records[21].gain_vs_graph == pytest.approx(0.0840, abs=5e-4)
    assert records[21].gain_lo is not None and records[21].gain_lo <= records[21].gain_hi
    assert records[1].seed_name == "paper" and records[1].feasible is False


def test_a_small_job_gets_a_note_instead_of_importance(tmp_path):
    full = tmp_path / "full.db"
    small = tmp_path / "small.db"
    out = tmp_path / "out"
    report(write_finished_study(full), None, out)
    assert (out / "param_importance.png").is_file()
    files = report(write_finished_study(small, first=4), None, out)  # 4 measured trials, into the same directory
    assert files.importance is None
    assert not (out / "param_importance.png").exists()  # the bigger job's figure would contradict this page
    page = _check_files(files)
    assert "it needs at least 10 measured trials and this job has 4" in " ".join(page.text)


def test_a_job_without_a_measured_trial_still_reports(tmp_path):
    study = optuna.create_study(directions=["maximize", "minimize"])
    study.set_user_attr("max_ne_gap", 0.02)
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL,
                                              user_attrs={"failure_kind": "infra", "failure_reason": "no GPU"}))
    files = write_report(study, tmp_path)
    page = _check_files(files)
    assert "No measured plan is within the NE budget." in " ".join(page.text)
    assert page.table("trial", "kind") == [["0", "infra", "no GPU", "-"]]


def _one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert message and "\n" not in message, message
    return message


def test_an_unusable_output_directory_is_one_line(finished, tmp_path):
    a_file = tmp_path / "report.html"
    a_file.write_text("not a directory")
    with pytest.raises(EraseTuneError) as e:
        report(finished, None, a_file)
    assert f"{a_file} is not a directory" in _one_line(e)
    with pytest.raises(EraseTuneError) as e:
        report(finished, None, a_file / "sub")
    assert "cannot create it" in _one_line(e)
    with pytest.raises(EraseTuneError) as e:  # /proc cannot be written, not even by root
        report(finished, None, "/proc")
    assert "cannot write there" in _one_line(e)


def test_a_missing_database_is_an_error_not_a_new_file(tmp_path):
    missing = tmp_path / "typo.db"
    with pytest.raises(EraseTuneError) as e:
        report(f"sqlite:///{missing}", None, tmp_path / "out")
    assert "no database file" in _one_line(e)
    assert not missing.exists()


def test_a_study_that_is_not_an_erase_tune_job_is_one_line(tmp_path):
    study = optuna.create_study(direction="minimize")
    with pytest.raises(EraseTuneError) as e:
        write_report(study, tmp_path)
    assert "is not an erase-tune job" in _one_line(e)
    study = optuna.create_study(directions=["maximize", "minimize"])
    with pytest.raises(EraseTuneError) as e:
        write_report(study, tmp_path)
    assert "has no NE budget" in _one_line(e)


def test_the_noise_floor_widens_feasibility_and_is_shown(finished, tmp_path):
    """A study with a measured noise floor: a gap above the budget but within budget + band is
    feasible (trial 5: +3.1% against 2% + 1.5%), the facts say so, the front figure changes."""
    url = f"sqlite:///{tmp_path / 'noisy.db'}"
    shutil.copy(finished.removeprefix("sqlite:///"), tmp_path / "noisy.db")
    study = optuna.load_study(study_name=STUDY_NAME, storage=url)
    before = {r.number: r.feasible for r in read_records(study)}
    floor = {"band": 0.015, "gaps": [0.015, -0.004], "kinds": ["order", "graph"], "ne_reference": 0.8,
             "training_steps": 268, "repeats": 1, "provenance": {}}
    study.set_user_attr("noise_floor", floor)
    study.set_user_attr("ne_noise_band", 0.015)
    after = {r.number: r.feasible for r in read_records(study)}
    assert before[5] is False and after[5] is True
    assert {n for n in after if after[n] and not before[n]} == {
        r.number for r in read_records(study) if r.measured and MAX_NE_GAP < r.ne_gap <= MAX_NE_GAP + 0.015}
    plain = report(finished, None, tmp_path / "plain")
    files = report(url, None, tmp_path / "noisy")
    page = _check_files(files)
    facts = dict(page.table("fact", "value"))
    assert facts["noise floor of the NE gap"].startswith("±1.50%: the baseline trained against itself for 268 steps")
    assert "beyond 3.50%" in facts["noise floor of the NE gap"]
    assert "not measured" in dict(_check_files(plain).table("fact", "value"))["noise floor of the NE gap"]
    assert files.pareto_front.read_bytes() != plain.pareto_front.read_bytes()


@pytest.mark.parametrize("command", [["status"], ["status", "--trial", "0"], ["report", "-o", "{out}"],
                                     ["db", "upgrade"], ["export", "-o", "{out}.yaml"]])
def test_reading_a_study_loads_no_torch(tmp_path, command):
    """``status``, ``report``, ``db`` and the export of a confirmed front read stored records:
    they start in about a second, not the three that importing torch takes (the runtime, the
    measurement and the workloads packages import what needs torch on first use)."""
    import json
    import subprocess
    import sys

    from erase_tune.store.storage import open_storage
    from tests.tune.studies import confirm_front

    url = write_finished_study(tmp_path / "study.db", gain_over="eager")
    if command[0] == "export":  # a finished job whose front is confirmed: export writes without Ray
        space = tmp_path / "space.yaml"
        shutil.copy(ROOT / "search_spaces" / "ctr-smoke.yaml", space)
        db = open_storage(url)
        try:
            confirm_front(db, STUDY_NAME, str(space), space.read_text())
        finally:
            db.close()
    argv = [a.replace("{out}", str(tmp_path / "out")) for a in command] + ["--storage", url]
    if command[0] != "db":
        argv += ["--study", STUDY_NAME]
    code = ("import json, sys; from erase_tune.cli import main; code = main(%r); "
            "print(json.dumps([code, 'torch' in sys.modules]))" % argv)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    exit_code, torch_loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert exit_code == 0, done.stderr
    assert not torch_loaded, f"erase-tune {' '.join(command)} imported torch"
