"""Tests for measurement provenance records."""

from __future__ import annotations

import datetime
import json

import pytest
import torch

from erase_tune.measure import provenance

REQUIRED = {"device", "device_name", "torch", "cuda", "cudnn", "python", "hostname", "date_utc"}


def test_cpu_record_is_json_and_complete():
    record = provenance(torch.device("cpu"), workload={"name": "ctr", "batch": 2048}, steps=100, seed=0)
    assert REQUIRED <= record.keys()
    assert record["device"] == "cpu"
    assert record["device_name"]
    assert record["torch"] == torch.__version__
    assert (record["workload"], record["steps"], record["seed"]) == ({"name": "ctr", "batch": 2048}, 100, 0)
    assert datetime.datetime.fromisoformat(record["date_utc"]).utcoffset() == datetime.timedelta(0)
    assert json.loads(json.dumps(record)) == record


def test_extra_cannot_overwrite_or_be_unserialisable():
    with pytest.raises(ValueError, match="device_name"):
        provenance(torch.device("cpu"), device_name="H100")
    with pytest.raises(TypeError, match="model"):
        provenance(torch.device("cpu"), model=object())


@pytest.mark.gpu
def test_cuda_record_names_the_gpu():
    record = provenance(torch.device("cuda"))
    assert record["device_name"] == torch.cuda.get_device_name()
    assert record["cuda"] == torch.version.cuda
    assert json.loads(json.dumps(record)) == record
