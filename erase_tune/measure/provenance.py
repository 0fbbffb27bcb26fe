"""Provenance of a measurement: where, with what, and when a figure was taken.

docs/design.md: every figure carries its device name, torch/CUDA versions, workload args, steps,
seed and date. A ratio measured on an H200 with torch 2.11 says little about an H100 with
another CUDA, so the record travels with the numbers (as a plain JSON-ready dict).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
from typing import TYPE_CHECKING, Any

import erase_tune

if TYPE_CHECKING:
    import torch

__all__ = ["provenance"]


def provenance(device: torch.device, **extra: Any) -> dict[str, Any]:
    """A JSON-serialisable record of the environment, plus ``extra`` (workload args, steps, seed, ...).

    ``extra`` may not override a recorded key (a caller could otherwise relabel the device)
    and must itself be JSON-serialisable; both mistakes raise with the key named.
    """
    import torch  # here, not above: the package imports this module, and reading records needs no torch

    device = torch.device(device)
    record: dict[str, Any] = {
        "device": str(device),
        "device_name": _device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "erase_tune": erase_tune.__version__,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        record["device_capability"] = f"{major}.{minor}"
        record["device_count"] = torch.cuda.device_count()
    for key, value in extra.items():
        if key in record:
            raise ValueError(f"provenance: extra key {key!r} would overwrite the recorded {key!r}")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as err:
            raise TypeError(f"provenance: extra {key!r} is not JSON-serialisable: {err}") from None
        record[key] = value
    return record


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return _cpu_name()


def _cpu_name() -> str:
    # platform.processor() is empty on most Linux machines; /proc/cpuinfo names the model.
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"
