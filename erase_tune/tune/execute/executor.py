"""Ray trial execution: a pool of warm worker groups, one trial per group at a time.

``RayExecutor`` joins the cluster named by ``--ray-address`` or, when that is not given,
by ``RAY_ADDRESS`` (what ``ray job submit`` and KubeRay's RayJob set); with neither it
starts a private local Ray (the embedded default) and makes sure its processes die with
the driver, even on ``kill -9`` (:mod:`erase_tune.tune.execute.reaper`). The workload's package
travels to the workers through Ray's ``runtime_env`` (``working_dir``/``py_modules``).

Each slot is a :class:`~erase_tune.tune.execute.actors.WorkerGroup`; trials wait for GPUs to
appear (an autoscaling cluster may start with none) for up to ``gpu_wait_s``, and a group
is replaced after a failure unless its worker said it stays fit (``WorkerInfo.reusable``).
A hung trial is ended by killing its group's actors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from erase_tune._signals import stuck_thread
from erase_tune._env import UPLOAD_ENV, env_mebibytes, env_text
from erase_tune.errors import EraseTuneError, first_line, shown
from erase_tune.measure.estimate import duration, phase_limit
from erase_tune.tune.execute.outcome import ConfirmOutcome, Failure, TrialOutcome
from erase_tune.tune.execute.task import ConfirmSpec, ReferenceOutcome, ReferenceSpec, TrialSpec
from erase_tune.tune.execute.actors import WorkerGroup, release

__all__ = ["TrialHandle", "RayExecutor", "resolve_address", "runtime_env", "import_dirs"]


@dataclasses.dataclass(eq=False)
class TrialHandle:
    """A submitted trial; identity is the handle itself."""

    spec: TrialSpec
    group: WorkerGroup
    ref: Any
    others: list[Any]
    started: float = dataclasses.field(default_factory=time.monotonic)
    submitted_at: float = dataclasses.field(default_factory=time.time)
    cancel_reason: str | None = None


WAIT_SAID_AFTER_S = 30.0
"""A worker group not ready after this long is a wait worth a log line. Starting one takes 1-3 s,
and up to ~15 s on a loaded machine, where a refusal found while starting (a package that
did not travel) must stay the command's only line; a real wait lasts up to ``--gpu-wait``."""
WAIT_REPEAT_S = 60.0
"""How often a continuing wait is logged again."""
LACK_SAID_AFTER_S = 2.0
"""A group still waiting for its resources after this long, while the cluster has fewer free than
it needs (other jobs hold them), is a wait said at once, not after :data:`WAIT_SAID_AFTER_S`."""
MAX_UPLOAD_MB = 256.0
"""Default bound on what ``working_dir`` and ``py_modules`` ship to the workers, together
(``$ERASE_TUNE_MAX_UPLOAD_MB`` changes it): Ray zips and uploads it, silently, for every job;
its own hard limit is about 512 MiB, reached only after minutes of hashing."""
MAX_UPLOAD_FILES = 50_000
"""Most files counted before giving up (a tree that large is not a workload package)."""

log = logging.getLogger(__name__)

CLOSE_LIMIT_S = 15.0
"""How long :meth:`RayExecutor.close` waits for Ray to release the trial workers. Ray's own
processes may have been stopped with the driver (a SIGTERM to the whole process group, as
``timeout``, a shell's job control or ``kill -- -PGID`` send it): then each of its calls
blocks for a minute or more, waiting for a GCS or raylet that is gone."""

MAX_SLOTS = 1024
"""Most trials in flight at once (a bound on actors created, not a cluster limit seen so far)."""


def resolve_address(address: str | None) -> str | None:
    """``--ray-address``, else ``$RAY_ADDRESS``, else None (a private local Ray)."""
    if address is not None and not address.strip():
        raise EraseTuneError("--ray-address: must not be empty (leave it out for $RAY_ADDRESS or a private local Ray)")
    return address or env_text("RAY_ADDRESS") or None


RAY_START_TIMED_OUT = "timed out during startup"
"""Ray's words when its raylet did not register within the 30 s it waits (a constant in
``ray._private.node``, not a setting): on a machine busy enough that starting a GCS, a raylet
and their agents takes longer. A private local Ray is then started once more."""


LOCAL_RAY_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False,
                    "enable_metrics_collection": False}
"""A private local Ray starts no idle Python workers ahead of need: Ray would start one per CPU,
for tasks of the default runtime environment, and this Ray runs only trial actors, whose
runtime environment is their own (actors.WORKER_ENV), so none of them could use one. Each costs
about 0.6 CPU-s to start and 0.35 CPU-s a minute idle (measured on two cores: a whole idle local
Ray, 2.6 CPU-s a minute with them, 1.7 without). Nor does it collect metrics: it has no dashboard
to show them, and collecting them is a fifth of what it costs idle (another day, the same two
cores: 2.07 CPU-s a minute with, 1.65 without), taken from the host the trials are timed on."""


def _start_ray(ray: Any, address: str | None, env: dict[str, Any]) -> None:
    """Join the Ray cluster at ``address``, or start a new local one (its child processes reaped
    when this process exits); one line saying why not."""
    try:
        if address:
            ray.init(address=address, runtime_env=env or None, log_to_driver=False, logging_level="error")
        else:
            _start_local_ray(ray, env)
    except Exception as e:  # noqa: BLE001 - Ray raises anything from a bad address (AssertionError too)
        where = f"at {address!r}" if address else "locally"
        raise EraseTuneError(f"cannot start or join Ray {where}: {first_line(e)}") from None


def _start_local_ray(ray: Any, env: dict[str, Any]) -> None:
    """A new Ray of this machine's CPUs ("local": even if another cluster runs here), started
    again once if Ray's own start-up timed out; what a failed start left running is killed."""
    import psutil

    from erase_tune.tune.execute.reaper import reap_children_on_exit

    for attempt in (1, 2):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False,
                     runtime_env=env or None, log_to_driver=False, logging_level="error",
                     object_store_memory=256 * 1024**2, _system_config=LOCAL_RAY_CONFIG)
            break
        except Exception as e:
            ray.shutdown()
            for p in psutil.Process().children(recursive=True):  # a half-started GCS, raylet, agents
                if p.pid not in before:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
            if attempt == 2 or RAY_START_TIMED_OUT not in str(e):
                raise
            log.warning("Ray's start-up timed out (its raylet did not register within the 30 s Ray waits: this "
                        "machine is busy); starting a local Ray once more")
    reap_children_on_exit()


class RayExecutor:
    """Runs trial specs on warm worker groups, ``slots`` at a time."""

    def __init__(self, address: str | None = None, *, workload: str, slots: int | None = None,
                 device: str = "auto", gpus_per_trial: int = 1, runtime_env: Mapping[str, Any] | None = None,
                 gpu_wait_s: float = 600.0, on_ray_started: Callable[[], None] | None = None) -> None:
        """``on_ray_started`` is called in this process once Ray is up (ray.init installs a SIGTERM
        handler of its own: a program that handles SIGTERM puts its handler back there)."""
        import ray

        self._ray = ray
        self._started_ray = False
        address = resolve_address(address)
        if slots is not None and not 1 <= slots <= MAX_SLOTS:
            raise EraseTuneError(f"--slots: {slots} must be in 1..{MAX_SLOTS}")
        if address and address != "auto":
            _check_reachable(address)
        if not ray.is_initialized():
            _start_ray(ray, address, dict(runtime_env or {}))
            self._started_ray = True
        if on_ray_started is not None:
            on_ray_started()
        resources = ray.cluster_resources()
        gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 1))
        if device == "cuda" and not gpus and not address:
            if self._started_ray:
                ray.shutdown()
            raise EraseTuneError("device: cuda, but this machine has no GPU (a cluster joined with --ray-address or "
                                 "RAY_ADDRESS may add GPU workers later; a local Ray cannot)")
        self.use_gpu = device == "cuda" or (device == "auto" and gpus > 0)
        try:
            _check_fits(ray, address, gpus_per_trial, self.use_gpu, gpu_wait_s)
        except EraseTuneError:
            if self._started_ray:
                ray.shutdown()
            raise
        self.device = "cuda" if self.use_gpu else "cpu"
        self.gpus_per_trial = gpus_per_trial
        self.gpu_wait_s = gpu_wait_s
        self.slots = slots or max(1, (gpus if self.use_gpu else cpus) // gpus_per_trial)
        self._cluster = f"Ray {ray.__version__} ({'joined ' + address if address else 'local'}): {cpus} CPUs, {gpus} GPUs"
        self._workload = workload
        self._running: dict[Any, TrialHandle] = {}
        self._finished: list[tuple[TrialHandle, TrialOutcome]] = []
        """Trials that ended while a phase waited for a slot, until :meth:`wait` returns them."""
        self._groups: list[WorkerGroup] = []
        """The slots, started when a slot is first asked for (:meth:`idle`): a job refused after
        joining Ray (a GPU-only setting on a cluster without GPUs) started no worker."""
        self._since_ready = time.monotonic()
        self._wait_said: float | None = None
        self._lack_asked = 0.0
        self._starts: list[tuple[float, float]] = []
        """(created, ready) of each worker group (once per slot, and after failures)."""

    # -- slots -------------------------------------------------------------------------------

    @property
    def describe(self) -> str:
        """The cluster and the slots, in one line."""
        return (f"{self._cluster}; {self.slots} trial slot(s) of {self.gpus_per_trial} "
                f"{'GPU' if self.use_gpu else 'CPU'}(s)")

    def cap_slots(self, trials: int) -> None:
        """No more slots than ``trials``, the most a job will run (a 4-trial job on a machine of 16
        CPUs started 16 trial workers); only before the slots have started."""
        if not self._groups:
            self.slots = max(1, min(self.slots, trials))

    @property
    def worker_start_s(self) -> float:
        """Wall seconds during which some slot's workers were starting: slots that start side by
        side count once (16 CPU slots that each took 11 s to start cost the job 11 s, not 176)."""
        return covered_s(self._starts)

    def _new_group(self) -> WorkerGroup:
        return WorkerGroup(ranks=self.gpus_per_trial, use_gpu=self.use_gpu, workload=self._workload)

    def idle(self) -> int:
        """Ready slots with no trial; raises if no slot could start within ``gpu_wait_s``."""
        if not self._groups:  # the first ask: the slots start now, and the wait for them with them
            self._groups = [self._new_group() for _ in range(self.slots)]
            self._since_ready = time.monotonic()
        busy = {h.group for h in self._running.values()}
        ready = 0
        for g in list(self._groups):
            was = g.state
            state = g.poll()
            if state == "ready" and was != "ready":
                self._starts.append((g.created, time.monotonic()))
            if state == "broken":
                raise EraseTuneError(f"trial workers cannot start on this cluster: {g.failure.reason}")
            if state == "lost":
                self._replace(g)
            ready += state == "ready" and g not in busy
        if any(g.state == "ready" for g in self._groups) or self._running:
            self._since_ready = time.monotonic()
            self._wait_said = None
        elif time.monotonic() - self._since_ready > self.gpu_wait_s:
            what = f"{self.gpus_per_trial} GPU(s) on one node" if self.use_gpu else f"{self.gpus_per_trial} CPU(s)"
            have = self._ray.cluster_resources()
            raise EraseTuneError(f"waited {self.gpu_wait_s:.0f}s for {what} for a trial; the cluster has "
                                 f"{int(have.get('GPU', 0))} GPUs and {int(have.get('CPU', 0))} CPUs "
                                 "(add GPU workers, or raise --gpu-wait)")
        elif (waited := time.monotonic() - self._since_ready) > WAIT_SAID_AFTER_S or (
                waited > LACK_SAID_AFTER_S and self._wait_said is None and self._lacking()):
            self._say_waiting()
        return ready

    def _lacking(self) -> bool:
        """Whether a group waits for resources the cluster does not have free now (asked at most
        once a second): a wait for other jobs, not a slow start."""
        now = time.monotonic()
        if now - self._lack_asked < 1.0:
            return False
        self._lack_asked = now
        need = "GPU" if self.use_gpu else "CPU"
        return any(g.state == "placing" for g in self._groups) and \
            self._ray.available_resources().get(need, 0) < self.gpus_per_trial

    def _say_waiting(self) -> None:
        """Log what a trial waits for, how long at most and how to stop, when the wait begins
        and every WAIT_REPEAT_S after (at INFO: shown without -v)."""
        now = time.monotonic()
        if self._wait_said is not None and now - self._wait_said < WAIT_REPEAT_S:
            return
        self._wait_said = now
        what = (f"{self.gpus_per_trial} GPU(s) on one node" if self.use_gpu
                else f"{self.gpus_per_trial} CPU(s) on one node")
        have = self._ray.cluster_resources()
        waited = now - self._since_ready
        log.info(f"waiting for {what} to start trial workers ({waited:.0f}s of at most {self.gpu_wait_s:.0f}s; the "
                 f"cluster has {int(have.get('GPU', 0))} GPUs and {int(have.get('CPU', 0))} CPUs): Ctrl-C stops, "
                 "--gpu-wait sets the limit")

    def wait_ready(self) -> None:
        """Block until one slot's workers have started (imports done): a cluster that cannot
        run trials at all (a package that did not travel, no GPUs within ``gpu_wait_s``) is
        refused here, before the job touches its storage."""
        while not self.idle():
            time.sleep(0.2)

    def submit(self, spec: TrialSpec) -> TrialHandle:
        group = self._free_group()
        spec = dataclasses.replace(spec, device=self.device)
        ref, others = group.run(spec)
        handle = TrialHandle(spec=spec, group=group, ref=ref, others=others)
        self._running[ref] = handle
        return handle

    @property
    def running(self) -> list[TrialHandle]:
        return list(self._running.values())

    def wait(self, timeout: float) -> list[tuple[TrialHandle, TrialOutcome]]:
        """Trials that finished within ``timeout`` seconds (or already, while a phase waited for
        a slot), with their outcomes."""
        if not self._finished:
            self._harvest(timeout)
        done, self._finished = self._finished, []
        return done

    def _harvest(self, timeout: float) -> None:
        """Move the trials that finish within ``timeout`` seconds from running to finished: their
        outcomes read, a failed one's slot replaced, each slot free again for what comes next."""
        if not self._running:
            time.sleep(min(timeout, 0.2))
            return
        ready, _ = self._ray.wait(list(self._running), num_returns=1, timeout=timeout)
        if ready:
            ready, _ = self._ray.wait(list(self._running), num_returns=len(self._running), timeout=0)
        for ref in ready:
            handle = self._running.pop(ref)
            outcome = self._outcome(handle)
            if handle.cancel_reason or not outcome.worker.reusable:  # cancelled: its workers were killed
                self._replace(handle.group)
            self._finished.append((handle, outcome))

    def cancel(self, handle: TrialHandle, reason: str) -> None:
        """Kill a trial's workers; its outcome (failed, with ``reason``) comes from :meth:`wait`.
        A trial that has finished already keeps its outcome (its slot may be running a phase)."""
        if handle.ref not in self._running:
            return
        handle.cancel_reason = reason
        for a in handle.group.actors:
            self._ray.kill(a, no_restart=True)

    def confirm(self, spec: ConfirmSpec, timeout: float, attempts: int = 3,
                expected_s: float | None = None) -> ConfirmOutcome:
        """Run a confirmation on a free slot and wait for it (in all, at most ``timeout`` seconds,
        or :func:`~erase_tune.measure.estimate.phase_limit` of ``expected_s``, what it should take,
        when that is shorter); a worker or node lost meanwhile is an infrastructure failure, retried
        on a fresh slot like a trial's within what is left of that limit: the limit announced is
        the one kept."""
        limit = phase_limit(expected_s, timeout)
        deadline = time.monotonic() + limit
        what = {"speed": f"re-timing {len(spec.plans)} front plan(s) over {spec.windows} windows",
                "quality": f"training {len(spec.plans)} front plan(s) on other data orders for their NE gap",
                "noise": "measuring the NE gap's noise floor"}.get(spec.task, spec.task)
        about = f"about {duration(expected_s)}, " if expected_s else ""
        log.info(f"{what} on one trial slot: {about}stopped after {duration(limit)} at most; Ctrl-C stops (nothing "
                 "is stored for an unfinished confirmation)")
        outcome = ConfirmOutcome(failure=Failure(kind="infra", reason="no attempt made"))
        for attempt in range(attempts):
            if attempt:
                log.info(f"{what}: {outcome.failure.reason}; again on a fresh slot "
                         f"({duration(deadline - time.monotonic())} of its limit left)")
            outcome = self._confirm_once(spec, deadline, limit)
            if outcome.failure is None or outcome.failure.kind != "infra" or time.monotonic() >= deadline:
                break
        return outcome

    def _confirm_once(self, spec: ConfirmSpec, deadline: float, limit: float) -> ConfirmOutcome:
        group = self._free_slot(deadline)
        if group is None:
            return ConfirmOutcome(failure=Failure(kind="infra", reason="no free trial slot for the confirmation"))
        ref = group.confirm(dataclasses.replace(spec, device=self.device))
        ready, _ = self._ray.wait([ref], timeout=max(1.0, deadline - time.monotonic()))
        if not ready:
            self._replace(group)
            return ConfirmOutcome(failure=Failure(kind="trial", reason=f"confirmation timed out after {limit:.0f}s"))
        try:
            outcome = self._ray.get(ref)
        except self._ray.exceptions.RayTaskError as e:
            self._replace(group)
            return ConfirmOutcome(failure=Failure(kind="trial", reason=f"{type(e.cause).__name__}: "
                                                                        f"{first_line(e.cause)}", traceback=str(e)))
        except Exception as e:  # noqa: BLE001 - a worker or node lost during the confirmation
            self._replace(group)
            return ConfirmOutcome(failure=Failure(kind="infra", reason=f"worker died: {first_line(e)}"))
        if not outcome.worker.reusable:
            self._replace(group)
        return outcome

    def _free_slot(self, deadline: float) -> WorkerGroup | None:
        """A ready slot with no trial, waited for until ``deadline`` (then None). A trial that
        ends meanwhile gives its slot back here (its outcome waits for :meth:`wait`): the caller
        (the job's one thread) records nothing while it waits, and a phase retried after its slot's
        node was lost waited out its limit for a slot whose trial had long finished."""
        while True:
            self._harvest(0)
            if self.idle():
                break
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)
        return self._free_group()

    def _free_group(self) -> WorkerGroup:
        """The first ready slot with no trial (:meth:`idle` said there is one)."""
        busy = {h.group for h in self._running.values()}
        return next(g for g in self._groups if g.state == "ready" and g not in busy)

    def reference(self, spec: ReferenceSpec, timeout: float, attempts: int = 3) -> ReferenceOutcome:
        """Try the whole-step-graph reference on a free slot (rank 0's GPU) and wait for it (in
        all, at most ``timeout`` seconds); a lost worker is retried on a fresh slot within what is
        left. The slot is replaced after any try that did not capture: a failed capture can leave
        its process's CUDA state unfit for measuring."""
        outcome = ReferenceOutcome(failure=Failure(kind="infra", reason="no attempt made"))
        deadline = time.monotonic() + timeout
        for _ in range(attempts):
            group = self._free_slot(deadline)
            if group is None:
                return ReferenceOutcome(failure=Failure(kind="infra", reason="no free trial slot for the try"))
            ref = group.actors[0].reference.remote(dataclasses.replace(spec, device=self.device))
            ready, _ = self._ray.wait([ref], timeout=max(1.0, deadline - time.monotonic()))
            if not ready:
                outcome = ReferenceOutcome(failure=Failure(kind="trial", reason=f"timed out after {timeout:.0f}s"))
            else:
                try:
                    outcome = self._ray.get(ref)
                except self._ray.exceptions.RayTaskError as e:
                    outcome = ReferenceOutcome(failure=Failure(kind="trial", reason=f"{type(e.cause).__name__}: "
                                                                                     f"{first_line(e.cause)}"))
                except Exception as e:  # noqa: BLE001 - a worker or node lost during the try
                    outcome = ReferenceOutcome(failure=Failure(kind="infra", reason=f"worker died: {first_line(e)}"))
            if outcome.reason is not None:
                self._replace(group)
            if outcome.failure is None or outcome.failure.kind != "infra" or time.monotonic() >= deadline:
                break
        return outcome

    def close(self) -> None:
        """Cancel what runs, release the worker groups and stop the Ray this executor started.

        Done on a thread and given up after :data:`CLOSE_LIMIT_S`: a Ray whose processes were
        stopped too never answers, and the command must still end. It then also drops Ray's
        exit hook, which would block the same way, and the command ends past the stuck thread
        (erase_tune._signals.stuck_thread); what is left is Ray's (the workers of a local Ray
        die with it, a cluster's are fate-shared with this driver)."""
        box: dict[str, BaseException] = {}

        def work() -> None:
            try:
                self._close()
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                box["error"] = e

        worker = threading.Thread(target=work, name="ray-close", daemon=True)
        worker.start()
        worker.join(CLOSE_LIMIT_S)
        if worker.is_alive():
            import atexit

            atexit.unregister(self._ray.shutdown)
            stuck_thread("Ray releasing the trial workers")
            log.warning("Ray did not answer within %.0fs while releasing the trial workers (its processes may have "
                        "been stopped with this one); not waiting for it", CLOSE_LIMIT_S)
            return
        if "error" in box:
            raise box["error"]

    def _close(self) -> None:
        for handle in list(self._running.values()):
            self.cancel(handle, "interrupted")
        self._running.clear()
        self._finished.clear()
        release(self._groups)
        if self._started_ray:
            self._ray.shutdown()
            self._started_ray = False

    # -- internals ---------------------------------------------------------------------------

    def _outcome(self, handle: TrialHandle) -> TrialOutcome:
        number = handle.spec.trial_number
        try:
            outcome = self._ray.get(handle.ref)
            for other in self._ray.get(handle.others):  # a rank > 0 that failed fails the trial
                if not other.complete and outcome.complete:
                    outcome = dataclasses.replace(other, trial_number=number)
            return outcome
        except self._ray.exceptions.RayTaskError as e:  # the worker raised: the trial's failure, not the node's
            return TrialOutcome(trial_number=number, failure=Failure(
                kind="trial", reason=f"{type(e.cause).__name__}: {first_line(e.cause)}", traceback=str(e)))
        except Exception as e:  # noqa: BLE001 - killed, crashed or lost workers
            if handle.cancel_reason:
                return TrialOutcome(trial_number=number, failure=Failure(kind="trial", reason=handle.cancel_reason))
            return TrialOutcome(trial_number=number,
                                failure=Failure(kind="infra", reason=f"worker died: {type(e).__name__}: "
                                                                     f"{first_line(e)}"))

    def _replace(self, group: WorkerGroup) -> None:
        """A fresh group in ``group``'s slot; the old one is released on a thread: removing a
        placement group waits for Ray's answer, which never comes if Ray's processes were
        stopped with this driver, and the driver must still hear a signal (:meth:`close`)."""

        def free() -> None:
            with contextlib.suppress(Exception):  # its node may be gone already
                release([group])

        threading.Thread(target=free, name="ray-release-group", daemon=True).start()
        self._groups[self._groups.index(group)] = self._new_group()


def covered_s(spans: Sequence[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start, end)`` spans: overlaps count once."""
    total, end = 0.0, float("-inf")
    for began, ended in sorted(spans):
        total += max(0.0, ended - max(began, end))
        end = max(end, ended)
    return total


def _check_reachable(address: str) -> None:
    """Fail in seconds, with one line, where Ray would retry an unreachable head for minutes
    (the GCS at ``host:port``, or the client server at ``ray://host:port``)."""
    bare = address.removeprefix("ray://")
    host, sep, port = bare.rpartition(":")
    if not sep or not host or not port.isdigit() or len(port) > 5 or not 0 < int(port) < 65536:
        shown = address if len(address) <= 80 else address[:79] + "…"
        raise EraseTuneError(f"--ray-address: {shown!r} is not auto, host:port or ray://host:port (port 1..65535)")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            answer = _grpc_answer(conn)
    except OSError as e:
        raise EraseTuneError(f"--ray-address: nothing answers at {address} ({e.strerror or e})") from None
    if answer is not None:
        raise EraseTuneError(f"--ray-address: something answers at {address}, and it is not Ray ({answer}); Ray "
                             "would wait for it for minutes: check the host and port")


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""An HTTP/2 client's preface and an empty SETTINGS frame: every gRPC server (Ray's GCS, its
client server) answers with a SETTINGS frame of its own."""
PROBE_S = 2.0
"""How long the head may take to answer the probe."""


def _grpc_answer(conn: socket.socket) -> str | None:
    """None if the peer speaks gRPC's HTTP/2 (as Ray's GCS and client server do), else what it
    did instead: a port where another service listens would have ray.init retry for minutes,
    printing its own warnings, with nothing said by us. Not checked where Ray runs over TLS."""
    if os.environ.get("RAY_USE_TLS", "").strip().lower() in ("1", "true"):
        return None
    conn.settimeout(PROBE_S)
    head = b""
    try:
        conn.sendall(_HTTP2_PREFACE)
        while len(head) < 9:
            chunk = conn.recv(9 - len(head))
            if not chunk:
                return "it closed the connection" if not head else f"it answered {head!r}"
            head += chunk
    except TimeoutError:
        return f"no answer within {PROBE_S:g} s" if not head else f"it answered {head!r} and stopped"
    except OSError as e:
        return f"the connection failed: {e.strerror or e}"
    if head[3] != 0x04:  # an HTTP/2 frame header whose type is SETTINGS
        return f"it answered {head!r}"
    return None


def _check_fits(ray: Any, address: str | None, ranks: int, use_gpu: bool, wait_s: float) -> None:
    """Refuse a trial no node can ever hold: a private local Ray cannot grow, so a trial of
    more ranks (one CPU each, and one GPU each on GPUs) than this machine has would wait for
    ``--gpu-wait`` seconds and then fail. A joined cluster may autoscale: there it is a wait,
    said at once."""
    need = {"CPU": ranks, **({"GPU": ranks} if use_gpu else {})}
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive", True)]
    if any(all(node.get(k, 0) >= v for k, v in need.items()) for node in nodes):
        return
    biggest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)), default={})
    what = f"{ranks} GPU(s) and {ranks} CPU(s)" if use_gpu else f"{ranks} CPU(s) (one per rank)"
    has = f"{int(biggest.get('GPU', 0))} GPU(s) and {int(biggest.get('CPU', 0))} CPU(s)"
    if not address:
        raise EraseTuneError(f"gpus_per_trial: {ranks} ranks need {what} on one node, and this machine's private local "
                             f"Ray has {has}; it cannot grow: lower gpus_per_trial in the space, or join a cluster "
                             "that has them with --ray-address")
    log.warning(f"no node of the cluster at {address} has {what} now (the largest has {has}); waiting up to "
                f"{wait_s:.0f}s for the autoscaler to add one: Ctrl-C stops, --gpu-wait sets the limit")


def _tree_size(root: str, limit: int) -> tuple[int, int]:
    """Bytes and files under ``root`` (a file counts itself), counting stops past ``limit``
    bytes or MAX_UPLOAD_FILES files; ``.git`` is skipped (Ray does not ship it either)."""
    if not os.path.isdir(root):
        return os.path.getsize(root), 1
    total = files = 0
    for top, dirs, names in os.walk(root, onerror=None):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in names:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except OSError:
                continue
            files += 1
            if total > limit or files > MAX_UPLOAD_FILES:
                return total, files
    return total, files


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def import_dirs(env: Mapping[str, Any]) -> list[str]:
    """Where the code a :func:`runtime_env` ships imports from: each py_module's parent
    directory, then the working_dir (what a driver that imports it too puts on its path)."""
    working_dir = env.get("working_dir")
    return [path if path == working_dir else os.path.dirname(path)
            for path in [*env.get("py_modules", []), working_dir] if path]


def runtime_env(working_dir: str | None, py_modules: Sequence[str]) -> dict[str, Any]:
    """Ray's ``runtime_env`` that ships a user's workload package to the workers; what it
    ships is measured first and bounded (``$ERASE_TUNE_MAX_UPLOAD_MB``, default MAX_UPLOAD_MB)."""
    env: dict[str, Any] = {}
    for path in [p for p in [working_dir, *py_modules] if p]:
        if not os.path.exists(path):
            # quoted: a trailing space or newline copied along must show (issue 30)
            raise EraseTuneError(f"--working-dir/--py-module: {shown(path, 300)} does not exist")
    limit = int(env_mebibytes(UPLOAD_ENV, MAX_UPLOAD_MB) * 2**20)
    total = 0
    for flag, path in [("--working-dir", working_dir), *(("--py-module", p) for p in py_modules)]:
        if not path:
            continue
        size, files = _tree_size(path, limit - total)
        total += size
        if files > MAX_UPLOAD_FILES:
            raise EraseTuneError(f"{flag}: {path} holds more than {MAX_UPLOAD_FILES} files ({_mib(size)} so far); Ray "
                                 "would zip and upload all of them to every worker: point it at the package's "
                                 "own directory")
        if total > limit:
            raise EraseTuneError(f"{flag}: {path} holds more than {_mib(size)}: with the rest, over the {_mib(limit)} "
                                 f"limit on what is shipped to the Ray workers: point it at the package's own "
                                 f"directory, or raise ${UPLOAD_ENV}")
        log.info(f"shipping {flag.removeprefix('--')} {path} to the Ray workers: {_mib(size)} in {files} file(s)")
    if working_dir:
        env["working_dir"] = os.path.abspath(working_dir)
    if py_modules:
        env["py_modules"] = [os.path.abspath(p) for p in py_modules]
    return env
