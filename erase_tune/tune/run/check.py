"""``erase-tune check --space FILE``: a dry run of a space that trains nothing and takes seconds.

What ``start`` would do before its first trial, on this machine and in this process, with no
Ray, no study and no storage: the space file is read and checked against its model
(:func:`~erase_tune.tune.search.checks.check_space`, the same check ``start`` makes), then

- each candidate with the modes the space gives it;
- how many plans the space can make: counted exactly by walking the space's conditional
  parameters when that is finite and small enough, else said so (a detached cut's λ is
  continuous);
- the screen's single-element plans (:mod:`erase_tune.tune.search.screen`), and every single
  structural change the modes name (graph X, place X, cut X, the whole-step graph) tried on the
  model as a trial would: the plan checked against the model and the probe (a cut the detach
  guard refuses alone is refused here with the guard's own line), an engine built on one example
  batch, and a few steps run (the first step checks every parameter got a gradient). A CUDA
  graph is captured only on CUDA: on a machine without one a graphed piece whose checks pass
  is reported as needing CUDA, not as an error;
- the baseline's step time measured here (:func:`erase_tune.measure.estimate.measure_step`: one
  example batch, a few timed steps);
- what the study would take: the phases ``start`` logs as ``estimate: ...``
  (:func:`phases`, which ``start`` uses too), from that step time.

Nothing here changes the process: the directories the workload imports from are handed to
the caller (``import_from``), as ``start`` does.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from erase_tune.errors import EraseTuneError, first_line
from erase_tune.measure.estimate import (
    JobShape,
    Phase,
    StepCost,
    TrialShape,
    describe_phases,
    job_phases,
    measure_step,
)
from erase_tune.measure.quality import quality_trainings
from erase_tune.runtime import EraseEngine, ErasePlan
from erase_tune.runtime.device import resolve_device
from erase_tune.measure.trial import GRAPH_WARMUP, reference_capture_error
from erase_tune.tune.execute.executor import MAX_SLOTS
from erase_tune.tune.run.confirm import MAX_CONFIRMED
from erase_tune.tune.search.checks import check_space
from erase_tune.tune.search.codec import BoundSpace
from erase_tune.tune.search.screen import Screen
from erase_tune.tune.search.space import MAX_TRIALS, AuxWeight, SearchSpace, WorkloadSpec
from erase_tune.workloads import Workload, get_workload

__all__ = ["SpaceCheck", "Element", "PlanCount", "check_space_file", "count_plans", "phases", "MAX_WALK", "MAX_WALK_S"]

MAX_WALK = 100_000
"""Parameter sets walked at most to count a space's plans; a larger space is said to be larger."""
MAX_WALK_S = 5.0
"""Seconds the count may take: a space it cannot walk in that time is said to be larger."""
TIMED_STEPS = 5
"""Steps the baseline is timed for (after 3 untimed), on one example batch."""
CHECK_STEPS = 2
"""Steps an element's engine runs on the CPU (the first checks every parameter got a gradient)."""

OK, REFUSED, NEEDS_CUDA = "ok", "refused", "needs CUDA"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Element:
    """One single structural change tried on the model."""

    name: str
    """``graph top_l``, ``place bot_l``, ``cut subarchs.0``, ``whole-step graph``."""
    status: str
    """``ok``, ``refused`` or ``needs CUDA``."""
    reason: str | None = None
    """Why it is refused or needs CUDA, one line; None when ok."""
    screened: bool = False
    """Whether the structural screen measures it first."""
    plan: str = ""
    """The plan, described in one line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanCount:
    """How many plans a space can make."""

    plans: int | None
    """Distinct canonical plans (with each cut's λ at its low end when λ is searched); None:
    more parameter sets than could be walked (:data:`MAX_WALK`, :data:`MAX_WALK_S`), not counted."""
    continuous: bool
    """A detached cut's λ is searched over a range: infinitely many plans."""
    walked: int
    """Parameter sets walked."""

    def describe(self, aux_weight: AuxWeight) -> str:
        walked = f"more than the {self.walked} parameter sets walked in {MAX_WALK_S:g} s"
        if self.continuous:
            low, high = aux_weight.low, aux_weight.high
            size = f"{self.plans} distinct plans" if self.plans is not None else f"{walked} (not counted)"
            return f"infinitely many: each detached cut's λ is continuous in [{low:g}, {high:g}]; up to λ, {size}"
        return f"{self.plans} (exact)" if self.plans is not None else f"finite, but {walked} (not counted exactly)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpaceCheck:
    """What :func:`check_space_file` found."""

    space: str
    workload: str
    device: str
    """Where the step was measured: ``cpu``, ``cuda:0``."""
    device_note: str | None
    """Why the device differs from the space's, or None."""
    candidates: list[tuple[str, tuple[str, ...]]]
    """Each candidate and its modes."""
    count: PlanCount
    plans_line: str
    screen: list[str]
    """The screen's single-element plans, in order (empty: the space turns the screen off)."""
    screen_on: bool
    elements: list[Element]
    step_ms: float
    build_s: float
    timed_steps: int
    trials: int
    slots: int
    phases: list[Phase]
    estimate: str

    def text(self) -> str:
        """What ``erase-tune check`` prints."""
        width = max([len(c) for c, _ in self.candidates] + [len(e.name) for e in self.elements] + [8])
        lines = [f"space {self.space}: workload {self.workload}; checked against its model (nothing trained, "
                 "no Ray, no study, no database)",
                 f"candidates ({len(self.candidates)}):"]
        lines += [f"  {c:<{width}}  {', '.join(m)}" for c, m in self.candidates]
        lines.append(f"plans: {self.plans_line}")
        if not self.screen_on:
            lines.append("screen: off (sampler.screen: false)")
        else:
            lines.append(f"screen: {len(self.screen)} single-element plans first"
                         + (f": {', '.join(self.screen)}" if self.screen else ""))
        lines.append(f"single elements on this model ({self.device}):")
        for e in self.elements:
            tag = "" if e.screened or e.status != OK else "  (not screened)"
            lines.append(f"  {e.name:<{width}}  {e.status}{': ' + e.reason if e.reason else ''}{tag}")
        if self.device_note:
            lines.append(self.device_note)
        lines.append(f"baseline step: {self.step_ms:.2f} ms on {self.device} (median of {self.timed_steps} timed "
                     f"steps on one example batch; building the engine {self.build_s:.2f} s)")
        lines.append(f"estimate ({self.trials} trials, {self.slots} slot{'s' if self.slots > 1 else ''}): "
                     f"{self.estimate}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["candidates"] = [{"module": c, "modes": list(m)} for c, m in self.candidates]
        d["count"] = {"plans": self.count.plans, "infinite": self.count.continuous, "walked": self.count.walked}
        return d


def check_space_file(path: str | Path, *, trials: int | None = None, slots: int | None = None,
                     import_from: Callable[[Sequence[str]], None] = lambda dirs: None) -> SpaceCheck:
    """Check the space at ``path`` and measure what its study would take here (module
    docstring). ``trials``: the study's trials (default: the space's); ``slots``: trials in
    flight (default: as ``start`` on a private local Ray here: one per GPU, else one per CPU).
    ``import_from``: called with the directories the space's workload imports from first.
    Raises one line (EraseTuneError) for a space that ``start`` would refuse."""
    if trials is not None and not 1 <= trials <= MAX_TRIALS:
        raise EraseTuneError(f"--trials: {trials} must be in 1..{MAX_TRIALS}")
    space = SearchSpace.load(path)
    import_from(_import_dirs(space.workload))
    bound = check_space(space)
    workload = get_workload(space.workload.name, space.workload.args)
    device, note = _device(space)
    if space.gain_over == "graph" and device.type != "cuda":
        note = (f"{note}; " if note else "") + ("gain_over: graph needs GPU trial slots: start refuses it on a "
                                                "cluster without GPUs")
    if slots is not None and not 1 <= slots <= MAX_SLOTS:
        raise EraseTuneError(f"--slots: {slots} must be in 1..{MAX_SLOTS}")  # what start allows
    target = trials if trials is not None else space.trials
    # As start: no more slots than trials.
    slots = min(slots if slots is not None else _default_slots(device, space.gpus_per_trial), target)
    screen = Screen(bound)
    try:
        batch, init = workload.example(device), workload.build_model()
    except (EraseTuneError, RuntimeError, ValueError, TypeError) as e:
        raise EraseTuneError(f"{space.source}: the workload's example batch or model fails on {device}: "
                             f"{first_line(e)}") from None
    elements = [_guarded(bound, check_element(workload, name, plan, device, screened, batch=batch, init=init))
                for name, plan, screened in screen.every_single()]
    count = count_plans(bound)
    try:
        cost = measure_step(workload, device, steps=TIMED_STEPS)
    except (EraseTuneError, RuntimeError, ValueError, TypeError) as e:
        raise EraseTuneError(f"{space.source}: the baseline's step fails on {device}: {first_line(e)}") from None
    screen_on = space.sampler.screen
    ph = phases(space, cost, left=target, singles=len(screen.singles) if screen_on else None,
                cuda=device.type == "cuda", slots=slots, noise_due=True, confirm_windows=5)
    return SpaceCheck(
        space=space.source, workload=space.workload.name, device=str(device), device_note=note,
        candidates=[(c, tuple(bound.modes[c])) for c in bound.candidates],
        count=count, plans_line=count.describe(space.cuts.aux_weight),
        screen=[s.name for s in screen.singles] if screen_on else [], screen_on=screen_on,
        elements=elements, step_ms=cost.step_s * 1e3, build_s=cost.build_s, timed_steps=TIMED_STEPS, trials=target,
        slots=slots, phases=ph, estimate=describe_phases(ph))


def phases(space: SearchSpace, cost: StepCost, *, left: int, singles: int | None, cuda: bool, slots: int,
           noise_due: bool, confirm_windows: int) -> list[Phase]:
    """The phases of a job of ``left`` more trials and what each takes (erase_tune.measure.estimate):
    ``singles``: the screen's single plans (None: no screen); ``cuda``: trials run on CUDA
    (they also time the whole-step graph); ``noise_due``: the noise floor is still to measure;
    ``confirm_windows``: 0 without the confirmation at the end. ``start`` logs these."""
    b = space.budget.per_trial
    # the singles and, at most, as many unions again (pairs and the all-union of the gainers)
    screen = min(left, 2 * singles) if singles is not None else 0
    quality_runs = quality_trainings(MAX_CONFIRMED, b, floor=bool(b.noise_repeats)) * b.quality_scale
    trial = TrialShape(warmup_steps=b.warmup_steps, window_steps=b.window_steps, min_windows=b.windows,
                       max_windows=b.max_windows, quality_steps=b.quality_steps, training_steps=b.training_steps,
                       reference=b.reference and cuda, may_detach=space.may_detach)
    job = JobShape(screen_plans=screen, search_trials=left - screen,
                   noise_runs=(b.noise_repeats + 1) if b.noise_repeats and noise_due else 0,
                   confirm_plans=MAX_CONFIRMED if confirm_windows else 0, confirm_min_windows=confirm_windows,
                   confirm_max_windows=max(confirm_windows, space.budget.confirm_max_windows), quality_runs=quality_runs)
    out = job_phases(cost, trial, job)
    if slots > 1:  # trials share the slots; the rest runs on one
        out = [dataclasses.replace(p, low_s=p.low_s / slots, high_s=p.high_s / slots)
               if p.name in ("screen", "search") else p for p in out]
    return out


# -- the elements ---------------------------------------------------------------------------------


def check_element(workload: Workload, name: str, plan: ErasePlan, device: torch.device, screened: bool = False, *,
                  batch: Any = None, init: torch.nn.Module | None = None) -> Element:
    """Try one single-element plan on the model as a trial would (module docstring); ``batch``
    and ``init``: the workload's example batch on ``device`` and its model (made here if not given)."""
    described = plan.describe()
    graphs = bool(plan.graphs) or plan.whole_step_graph or any(c.graph for c in plan.cuts)
    if device.type == "cuda" and plan == ErasePlan(whole_step_graph=True):
        # The whole-step graph alone is the trials' reference: tried as the job's preflight tries it
        # (on the workload's batches; a failed capture's CUDA RNG state is repaired).
        try:
            error = reference_capture_error(workload, device)
        except (EraseTuneError, RuntimeError, ValueError, TypeError) as e:
            error = first_line(e)
        if error is not None:
            return Element(name=name, status=REFUSED, screened=screened, plan=described,
                           reason=f"{error} (start then tunes without the whole-step graph)")
        return Element(name=name, status=OK, screened=screened, plan=described)
    try:
        init = init if init is not None else workload.build_model()
        batch = batch if batch is not None else workload.example(device)
        plan.check_model(init)
        engine = EraseEngine(copy.deepcopy(init).to(device), plan, loss_fn=workload.loss_fn,
                             optimizer=workload.optimizer, example=batch, make_head=workload.make_head,
                             graph_warmup=GRAPH_WARMUP, output=workload.output, model_loss=workload.model_loss)
        try:
            # On CUDA a graph is captured after the warm-up and replayed once, as in a trial.
            for _ in range(GRAPH_WARMUP + 2 if graphs and device.type == "cuda" else CHECK_STEPS):
                engine.step(*batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        finally:
            engine.close()
    except (EraseTuneError, RuntimeError, ValueError, TypeError) as e:
        return Element(name=name, status=REFUSED, reason=first_line(e), screened=screened, plan=described)
    if graphs and device.type != "cuda":
        what = "the step" if plan.whole_step_graph else "the piece"
        return Element(name=name, status=NEEDS_CUDA, screened=screened, plan=described,
                       reason=f"its checks pass here; {what} is captured as a CUDA graph on a GPU only "
                              f"(on {device.type} it runs eagerly)")
    return Element(name=name, status=OK, screened=screened, plan=described)


def _guarded(bound: BoundSpace, element: Element) -> Element:
    """A cut refused alone says what the search does with it: the detach guard offers it only
    once the cuts upstream of it are chosen (or never, for a candidate no plan may detach)."""
    if element.status != REFUSED or not element.name.startswith("cut ") or bound.can_detach is None:
        return element
    candidate = element.name.removeprefix("cut ")
    if bound.can_detach([], candidate):
        return element
    never = candidate in getattr(bound.can_detach, "never", ())
    then = "the search never detaches it" if never else "the search offers it only with the cuts upstream of it"
    return dataclasses.replace(element, reason=f"{element.reason}; {then}")


# -- counting plans -------------------------------------------------------------------------------


class _Walk:
    """A trial that answers from ``prefix`` (choice indices) and takes the first choice after
    it, noting each question's number of choices: one leaf of the space's tree of parameters."""

    def __init__(self, prefix: Sequence[int]) -> None:
        self.prefix, self.taken, self.arity, self.continuous = list(prefix), [], [], False

    def _pick(self, n: int) -> int:
        i = self.prefix[len(self.taken)] if len(self.taken) < len(self.prefix) else 0
        self.taken.append(i)
        self.arity.append(n)
        return i

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        return choices[self._pick(len(choices))]

    def suggest_int(self, name: str, low: int, high: int) -> int:
        return low + self._pick(high - low + 1)

    def suggest_float(self, name: str, low: float, high: float, *, log: bool = False) -> float:
        self.continuous = self.continuous or low < high
        return low


_PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(ErasePlan) if f.name != "provenance")


def count_plans(bound: BoundSpace, limit: int = MAX_WALK, seconds: float = MAX_WALK_S) -> PlanCount:
    """The distinct canonical plans ``bound`` can make (each cut's λ at its low end), found by
    walking every parameter set of its conditional space; not counted past ``limit`` sets or
    ``seconds``."""
    plans: set[tuple[Any, ...]] = set()
    stack: list[list[int]] = [[]]
    walked, continuous = 0, False
    ends = time.monotonic() + seconds
    while stack:
        if walked >= limit or (walked % 256 == 0 and time.monotonic() > ends):
            return PlanCount(plans=None, continuous=continuous, walked=walked)
        prefix = stack.pop()
        walk = _Walk(prefix)
        plan = bound.plan(walk)  # canonical: equal plans are equal fields
        plans.add(tuple(getattr(plan, f) for f in _PLAN_FIELDS))
        continuous = continuous or walk.continuous
        walked += 1
        for j in range(len(prefix), len(walk.taken)):
            stack.extend([*walk.taken[:j], k] for k in range(1, walk.arity[j]))
    return PlanCount(plans=len(plans), continuous=continuous, walked=walked)


# -- where --------------------------------------------------------------------------------------


def _device(space: SearchSpace) -> tuple[torch.device, str | None]:
    """Where the step is measured here, and why it is not what the space says (or None)."""
    if space.device == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu"), ("device: cuda, but this machine has no CUDA device: measured on the CPU "
                                     "(the trials would run on a cluster's GPUs)")
    device = resolve_device(None if space.device == "auto" else space.device)
    note = f"device: auto, and this machine has no CUDA device: measured on the CPU" \
        if space.device == "auto" and device.type == "cpu" else None
    return device, note


def _default_slots(device: torch.device, gpus_per_trial: int) -> int:
    """Trials in flight on a private local Ray here, as ``start`` would run them."""
    units = torch.cuda.device_count() if device.type == "cuda" else (os.cpu_count() or 1)
    return max(1, units // gpus_per_trial)


def _import_dirs(workload: WorkloadSpec) -> list[str]:
    """Where the space's shipped code imports from: each py_module's parent, then the working_dir."""
    working_dir = [workload.working_dir] if workload.working_dir else []
    return [*(os.path.dirname(p) for p in workload.py_modules), *working_dir]
