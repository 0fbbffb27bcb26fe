"""Ray trial execution: one trial per GPU slot (or CPU slot), each in a fresh worker process.

``RayExecutor`` joins an existing cluster (``--ray-address auto`` or ``host:port``) or, with
no address, starts a local Ray in-process (the embedded default). Each trial is a task
with ``num_gpus=1`` (``0`` on a CPU-only cluster), ``max_calls=1`` so its worker process
exits afterwards (a crash or OOM frees the device), and no retries (a failing plan fails
again). A hung trial is cancelled with ``ray.cancel(force=True)`` and reported as failed.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any

from erase_tune.errors import EraseTuneError
from erase_tune.tune.worker import TrialSpec, run_spec

__all__ = ["TrialHandle", "RayExecutor"]


@dataclasses.dataclass(eq=False)
class TrialHandle:
    """A submitted trial; identity is the handle itself."""

    spec: TrialSpec
    ref: Any
    started: float
    cancel_reason: str | None = None
    submitted_at: float = dataclasses.field(default_factory=time.time)
    driver_s: float = 0.0
    plan_yaml: str = ""
    plan_summary: str = ""


def _ray_trial(spec: TrialSpec) -> dict[str, Any]:
    """Runs inside the Ray worker: the trial plus where it ran."""
    import ray

    ctx = ray.get_runtime_context()
    entered = time.time()
    outcome = run_spec(spec)
    outcome["process_started_at"] = _process_start()
    outcome["entered_at"] = entered
    outcome["ray_node"] = f"{ray.util.get_node_ip_address()}/{ctx.get_node_id()[:12]}"
    outcome["gpu_ids"] = [str(g) for g in ray.get_gpu_ids()]
    return outcome


def _check_reachable(address: str) -> None:
    """Fail in seconds, with one line, where Ray would retry an unreachable head for minutes."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise EraseTuneError(f"--ray-address: {address!r} is not auto or host:port")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise EraseTuneError(f"--ray-address: nothing answers at {address} ({e.strerror or e})") from None


def _process_start() -> float | None:
    """When this worker process was created (Ray starts one per trial)."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - accounting only
        return None


class RayExecutor:
    """Runs trial specs as Ray tasks, ``slots`` at a time."""

    def __init__(self, address: str | None = None, *, slots: int | None = None, device: str = "auto",
                 cpus_per_trial: int = 1) -> None:
        import ray

        self._ray = ray
        self._started_ray = False
        if address and address != "auto":
            _check_reachable(address)
        if not ray.is_initialized():
            try:
                if address:
                    ray.init(address=address, log_to_driver=False, logging_level="error")
                else:
                    # "local": always a new in-process Ray, even if another cluster runs on this machine.
                    ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
                             logging_level="error", object_store_memory=256 * 1024**2)
            except (ConnectionError, RuntimeError, ValueError) as e:
                where = f"at {address!r}" if address else "locally"
                raise EraseTuneError(f"cannot start or join Ray {where}: {str(e).strip().splitlines()[0]}") from None
            self._started_ray = True
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        cpus = int(resources.get("CPU", 1))
        if device == "cuda" and gpus == 0:
            raise EraseTuneError("device: cuda asked for, but the Ray cluster has no GPU")
        self.use_gpu = gpus > 0 and device != "cpu"
        self.device = "cuda" if self.use_gpu else "cpu"
        default_slots = gpus if self.use_gpu else max(1, cpus // cpus_per_trial)
        if slots is not None and slots < 1:
            raise EraseTuneError(f"--slots: {slots} must be >= 1")
        self.slots = slots or default_slots
        self.describe = (f"Ray {ray.__version__} ({'joined ' + address if address else 'local'}): "
                         f"{cpus} CPUs, {gpus} GPUs; {self.slots} trial slot(s) on {self.device}")
        self._task = ray.remote(max_calls=1, max_retries=0)(_ray_trial).options(
            num_gpus=1 if self.use_gpu else 0, num_cpus=cpus_per_trial,
        )
        self._running: dict[Any, TrialHandle] = {}

    @property
    def running(self) -> list[TrialHandle]:
        return list(self._running.values())

    def submit(self, spec: TrialSpec) -> TrialHandle:
        spec = dataclasses.replace(spec, device=self.device)
        handle = TrialHandle(spec=spec, ref=self._task.remote(spec), started=time.monotonic())
        self._running[handle.ref] = handle
        return handle

    def wait(self, timeout: float) -> list[tuple[TrialHandle, dict[str, Any]]]:
        """Trials that finished within ``timeout`` seconds, with their outcome dicts."""
        if not self._running:
            return []
        refs = list(self._running)
        ready, rest = self._ray.wait(refs, num_returns=1, timeout=timeout)
        if ready and rest:
            more, _ = self._ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        done = []
        for ref in ready:
            handle = self._running.pop(ref)
            done.append((handle, self._outcome(handle)))
        return done

    def cancel(self, handle: TrialHandle, reason: str) -> None:
        """Kill a trial's worker; its outcome (failed, with ``reason``) comes from :meth:`wait`."""
        handle.cancel_reason = reason
        self._ray.cancel(handle.ref, force=True)

    def _outcome(self, handle: TrialHandle) -> dict[str, Any]:
        try:
            return self._ray.get(handle.ref)
        except Exception as e:  # noqa: BLE001 - crashed, killed or cancelled workers are trial failures
            elapsed = time.monotonic() - handle.started
            if handle.cancel_reason:
                return {"status": "failed", "reason": handle.cancel_reason, "duration_s": elapsed}
            text = str(e).strip().splitlines()
            first = next((line for line in text if line.strip()), type(e).__name__)
            return {"status": "failed", "reason": f"worker died: {type(e).__name__}: {first[:300]}", "duration_s": elapsed}

    def close(self) -> None:
        for handle in list(self._running.values()):
            self.cancel(handle, "interrupted")
        self._running.clear()
        if self._started_ray:
            self._ray.shutdown()
            self._started_ray = False
