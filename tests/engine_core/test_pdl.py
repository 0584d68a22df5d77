"""PDL launch keywords: only CUDA devices of compute capability 9+ get them, never CPU
tensors, and ``DeviceConfig.triton_pdl`` (off under PDSERVE_TRITON_PDL=0 or the Triton
interpreter, read at the entry points) turns them off."""

from __future__ import annotations

from unittest import mock

import torch

from engine_core.arg_utils import engine_environment
from engine_core.kernels import pdl


def test_cpu_tensors_never_use_pdl():
    assert pdl.pdl_args(torch.device("cpu")) == {"USE_PDL": False}


def test_hopper_gets_pdl_unless_turned_off():
    pdl._supported.cache_clear()
    try:
        with mock.patch.object(torch.cuda, "get_device_capability", return_value=(9, 0)), \
                mock.patch.object(torch.cuda, "current_device", return_value=0):
            assert pdl.pdl_args(torch.device("cuda")) == {"USE_PDL": True, "launch_pdl": True}
            assert pdl.pdl_args(torch.device("cuda"), enabled=False) == {"USE_PDL": False}
    finally:
        pdl._supported.cache_clear()


def test_environment_sets_the_switch_at_the_entry_point():
    assert engine_environment({})["triton_pdl"] is True
    assert engine_environment({"PDSERVE_TRITON_PDL": "0"})["triton_pdl"] is False
    assert engine_environment({"TRITON_INTERPRET": "1"})["triton_pdl"] is False
    assert engine_environment({})["allow_long_max_model_len"] is False
    assert engine_environment({"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})[
        "allow_long_max_model_len"] is True
