"""is_compiled: torch.compile wrappers, in-place Module.compile() and Lightning's compiled-module marker."""

from __future__ import annotations

import torch

from lightning_gpuopt.perf.compiled import is_compiled


def test_plain_module_is_not_compiled():
    assert not is_compiled(torch.nn.Sequential(torch.nn.Linear(16, 16)))


def test_wrapper_in_place_and_lightning_marker_are_detected():
    layer = torch.nn.Linear(16, 16)
    assert is_compiled(torch.nn.Sequential(torch.compile(layer)))  # a compiled submodule
    in_place = torch.nn.Linear(16, 16)
    in_place.compile()
    assert is_compiled(in_place)
    marked = torch.nn.Linear(16, 16)
    marked._compiler_ctx = {"compiler": "dynamo"}
    assert is_compiled(marked)
