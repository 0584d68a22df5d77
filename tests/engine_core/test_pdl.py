"""PDL launch keywords: only CUDA devices of compute capability 9+ get them, never the
interpreter or CPU tensors, and PDSERVE_TRITON_PDL=0 turns them off."""

from __future__ import annotations

import subprocess
import sys

import torch

from engine_core.kernels.pdl import pdl_args


def test_cpu_tensors_never_use_pdl():
    assert pdl_args(torch.device("cpu")) == {"USE_PDL": False}


def _args_in_subprocess(env_value: str) -> str:
    code = ("import torch\n"
            "from unittest import mock\n"
            "from engine_core.kernels import pdl\n"
            "with mock.patch.object(torch.cuda, 'get_device_capability', return_value=(9, 0)), "
            "mock.patch.object(torch.cuda, 'current_device', return_value=0):\n"
            "    print(pdl.pdl_args(torch.device('cuda')))\n")
    env = {"PDSERVE_TRITON_PDL": env_value, "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_hopper_gets_pdl_unless_turned_off():
    assert _args_in_subprocess("1") == "{'USE_PDL': True, 'launch_pdl': True}"
    assert _args_in_subprocess("0") == "{'USE_PDL': False}"
