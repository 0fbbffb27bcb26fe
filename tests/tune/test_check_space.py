"""``erase-tune check --space FILE``: a dry run through the real CLI entry. It lists the space's
candidates and plans, tries every single element on the model (a cut the detach guard refuses is
named with the guard's line), times the baseline here and estimates the study; it trains
nothing and writes nothing (no database). A broken file is one line and exit 2. Also the
messages that point the user the right way: ``start --trials 0`` and a short ``--warmup`` on a CPU."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.tune.conftest import SMOKE, run_cli
from tests.tune.test_cli_errors import one_error_line

# A chain of two segments and a head: cutting the second segment alone would leave the first
# untrained (the detach guard offers it only once the first is cut); the head may be graphed.
MLP = """\
workload:
  name: mlp
  args: {batch: 16, width: 8, depth: 4, train_batches: 2, eval_batches: 1}
cuts:
  candidates: [layers.0:2, layers.2:4, {module: head, modes: [keep, place, graph]}]
  modes: [keep, place, detach]
  max_streams: 1
  dispatch: [blocking]
  aux_weight: 1.0
trials: 4
device: cpu
budget: {warmup_steps: 5, windows: 2, window_steps: 3, quality_steps: 10, timeout_s: 60, noise_repeats: 1,
         quality_scale: 1, quality_seeds: 1}
"""


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory (where the default storage, sqlite:///erase-tune.db, would go)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def lines_of(out: str) -> list[str]:
    return out.splitlines()


def test_check_ctr_smoke_lists_the_space_tries_its_elements_and_estimates(here, capsys):
    assert run_cli("check", "--space", SMOKE) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    out = lines_of(captured.out)
    assert out[0].startswith(f"space {SMOKE}: workload ctr;")
    assert out[1] == "candidates (6):"
    assert [line.split() for line in out[2:8]] == [[f"subarchs.{i}", "keep,", "place,", "detach"] for i in range(6)]
    plans = next(line for line in out if line.startswith("plans: "))
    assert plans.startswith("plans: infinitely many: each detached cut's λ is continuous in [0.3, 3]")
    screen = next(line for line in out if line.startswith("screen: "))
    singles = [*(f"place subarchs.{i}" for i in range(6)), *(f"cut subarchs.{i}" for i in range(6))]
    assert screen == f"screen: 12 single-element plans first: {', '.join(singles)}"
    start = out.index("single elements on this model (cpu):")
    elements = {line[:18].strip(): line[18:].strip() for line in out[start + 1: start + 13]}
    assert elements == {name: "ok" for name in singles}
    step = next(line for line in out if line.startswith("baseline step: "))
    assert re.fullmatch(r"baseline step: \d+\.\d\d ms on cpu \(median of 5 timed steps on one example batch; "
                        r"building the engine \d+\.\d\d s\)", step), step
    estimate = out[-1]
    assert re.match(r"estimate \(8 trials, \d+ slots?\): screen \(8 plans\) \S+; noise floor \(3 trainings .*; "
                    r"confirmation \(3 plans, 5\.\.40 windows\) \S+; quality .*; total \S+-\S+$", estimate), estimate
    # A dry run: no database, no journal, nothing at all written where it ran.
    assert list(here.iterdir()) == []
    assert not (here.parent / "journal").exists()


def test_check_names_the_refused_element_and_why(here, capsys):
    space = here.parent / "chain.yaml"
    space.write_text(MLP)
    assert run_cli("check", "--space", space, "--trials", "3", "--slots", "1") == 0
    out = lines_of(capsys.readouterr().out)
    assert [line.split() for line in out[2:5]] == [["layers.0:2", "keep,", "place,", "detach"],
                                                   ["layers.2:4", "keep,", "place,", "detach"],
                                                   ["head", "keep,", "place,", "graph"]]
    assert "plans: 48 (exact)" in out
    # The guard's cut is not screened; the graph is, and needs CUDA on a machine without one.
    assert "screen: 5 single-element plans first: graph head, place layers.0:2, place layers.2:4, place head, " \
           "cut layers.0:2" in out
    refused = next(line for line in out if line.lstrip().startswith("cut layers.2:4"))
    assert re.fullmatch(r"  cut layers\.2:4 +refused: plan leaves 6 parameters untrained: layers\.0\.linear\.weight, "
                        r".*\(cut 'layers\.2:4' detaches everything upstream of it\); the search offers it only "
                        r"with the cuts upstream of it", refused), refused
    assert re.fullmatch(r"  cut layers\.0:2 +ok", next(line for line in out if "cut layers.0:2 " in line))
    graph = next(line for line in out if line.lstrip().startswith("graph head"))
    assert re.fullmatch(r"  graph head +needs CUDA: its checks pass here; the piece is captured as a CUDA graph on a "
                        r"GPU only \(on cpu it runs eagerly\)", graph), graph
    assert out[-1].startswith("estimate (3 trials, 1 slot): screen (3 plans) ")
    assert list(here.iterdir()) == []


def test_check_json(here, capsys):
    space = here.parent / "chain.yaml"
    space.write_text(MLP)
    assert run_cli("check", "--space", space, "--json") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["count"] == {"plans": 48, "infinite": False, "walked": data["count"]["walked"]}
    status = {e["name"]: e["status"] for e in data["elements"]}
    assert status == {"graph head": "needs CUDA" if not torch.cuda.is_available() else "ok",
                      "place layers.0:2": "ok", "place layers.2:4": "ok", "place head": "ok",
                      "cut layers.0:2": "ok", "cut layers.2:4": "refused"}
    assert data["step_ms"] > 0 and data["trials"] == 4 and [p["name"] for p in data["phases"]][0] == "screen"


@pytest.mark.parametrize("text, needles", [
    ("workload: {name: ctr\n", ["broken.yaml", "not valid YAML"]),
    ("workload: {name: mlp}\ncuts: {candidates: [nope]}\n", ["broken.yaml: cuts.candidates:", "'nope'"]),
    ("workload: {name: mlp}\ntrials: 0\n", ["broken.yaml: trials:"]),
])
def test_check_a_broken_space_is_one_line_and_exit_2(here, capsys, text, needles):
    space = here.parent / "broken.yaml"
    space.write_text(text)
    assert run_cli("check", "--space", space) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    one_error_line(captured.err, *needles)
    assert list(here.iterdir()) == []


def test_check_refuses_a_missing_file_and_bad_numbers(here, capsys):
    assert run_cli("check", "--space", here / "nope.yaml") == 2
    one_error_line(capsys.readouterr().err, "nope.yaml")
    assert run_cli("check", "--space", SMOKE, "--trials", "0") == 2
    one_error_line(capsys.readouterr().err, "--trials: 0")


def test_start_trials_0_points_to_check(here, capsys):
    assert run_cli("start", "--space", SMOKE, "--trials", "0") == 2
    line = one_error_line(capsys.readouterr().err, "--trials: 0")
    assert line.endswith("use: erase-tune check --space FILE")
    assert list(here.iterdir()) == []  # refused before any storage is opened


@pytest.mark.parametrize("command", ["trial", "bench"])
def test_a_short_warmup_on_a_cpu_is_refused_with_a_line_true_there(here, capsys, command):
    plan = here.parent / "plan.yaml"
    plan.write_text("cuts: []\n")
    extra = ["--plan", plan] if command == "trial" else []
    assert run_cli(command, "--workload", "ctr", "--device", "cpu", "--warmup", "2", *extra) == 2
    line = one_error_line(capsys.readouterr().err, "budget.warmup_steps: 2 is too short",
                          "at least 5 untimed steps, on a CPU too", "no graph is captured there")
    assert not line.split("; ", 1)[1].startswith("CUDA graphs need")
