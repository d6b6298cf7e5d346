"""Devices the tests run on: the CPU always, a CUDA GPU where there is one.

GPU tests are marked ``gpu`` and skip without CUDA, saying so (``-ra`` counts them in the summary). On a
GPU machine ``scripts/test-gpu.sh`` sets ``KVDEPOT_REQUIRE_GPU=1``: nothing is skipped for want of CUDA
there, so a broken CUDA set-up fails instead of passing by skipping.
"""

from __future__ import annotations

import os

import pytest

from kvdepot.gpu.runtime import cuda_available

REQUIRE_GPU_ENV = "KVDEPOT_REQUIRE_GPU"
HAVE_CUDA = cuda_available()

requires_cuda = pytest.mark.skipif(
    not HAVE_CUDA and not os.environ.get(REQUIRE_GPU_ENV),
    reason="needs an NVIDIA GPU with CUDA (scripts/test-gpu.sh runs these on one)",
)
gpu = [pytest.mark.gpu, requires_cuda]

# A test parametrized over DEVICES runs its CPU case everywhere and its CUDA case on a GPU.
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=gpu)]
