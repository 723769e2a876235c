"""option_checks: a fix is named as the user writes it, in Python or in the gpuopt command."""

from __future__ import annotations

import ast

import pytest

import lightning_gpuopt.option_checks as option_checks
from lightning_gpuopt.cli.option_places import OPTION_GROUPS  # the command registers where its classes' options are
from lightning_gpuopt.option_checks import command_line_options, option, register_command_line_place
from lightning_gpuopt.perf.mfu import WindowTotals, summarise_windows


def test_an_option_is_the_python_argument_outside_the_command_and_the_flag_or_init_args_inside():
    cases = [  # (owner, name, value), Python, gpuopt
        (("AutoBatchSize", "max_micro_batch_size", 64), "AutoBatchSize(max_micro_batch_size=64)",
         "init_args: {max_micro_batch_size: 64} of AutoBatchSize in trainer.callbacks"),
        (("GPTModule", "learning_rate"), "GPTModule(learning_rate=...)", "--model.learning_rate"),
        (("TextDataModule", "num_workers", 8), "TextDataModule(num_workers=8)", "--data.num_workers 8"),
        (("ExactResume", "rebuild_loaders", True), "ExactResume(rebuild_loaders=True)", "--exact_resume.rebuild_loaders true"),
        (("Float8Precision", "emulate", True), "Float8Precision(emulate=True)", "init_args: {emulate: true} of Float8Precision in trainer.plugins"),
        (("Trainer.fit", "ckpt_path", "ckpt/last.ckpt"), "Trainer.fit(ckpt_path='ckpt/last.ckpt')", "--ckpt_path ckpt/last.ckpt"),
        (("MFUMonitor", "peak_flops"), "MFUMonitor(peak_flops=...)", "init_args.peak_flops of MFUMonitor in trainer.callbacks"),
    ]
    for args, python, command in cases:
        assert option(*args) == python
        with command_line_options():
            assert option(*args) == command
        assert option(*args) == python  # restored on leaving


def test_the_command_registers_its_classes_and_the_checks_name_none_of_their_own(monkeypatch):
    # The table is filled from above: option_checks' source names no class of a higher layer.
    tree = ast.parse(open(option_checks.__file__).read())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr)}
    strings = " ".join(n.value for n in ast.walk(tree)
                       if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings)
    assert all(name not in strings for name in ("GPTModule", "TextDataModule", "ExactResume", "Float8Precision"))
    assert "trainer.callbacks" in strings  # what the walk reads: the strings of the code
    assert OPTION_GROUPS["Trainer.fit"] == "" and option_checks._GROUPS["SigtermCheckpoint"] == "sigterm_checkpoint"
    monkeypatch.setattr(option_checks, "_GROUPS", dict(option_checks._GROUPS))
    monkeypatch.setattr(option_checks, "_LISTS", dict(option_checks._LISTS))

    class MyPlugin:
        pass

    with command_line_options():
        assert option("MyPlugin", "scale", 2) == "init_args: {scale: 2} of MyPlugin in trainer.callbacks"
        register_command_line_place(MyPlugin, listed_in="trainer.plugins")
        assert option("MyPlugin", "scale", 2) == "init_args: {scale: 2} of MyPlugin in trainer.plugins"
        register_command_line_place(MyPlugin, group="my")  # registered again: the last place holds
        assert option("MyPlugin", "scale", 2) == "--my.scale 2"
    with pytest.raises(ValueError, match=r"takes one of group= or listed_in="):
        register_command_line_place(MyPlugin)
    with pytest.raises(ValueError, match=r"takes one of group= or listed_in="):
        register_command_line_place(MyPlugin, group="my", listed_in="trainer.plugins")


def test_the_data_wait_advice_names_the_setting_it_is_given():
    slow_data = [WindowTotals(tokens=1000, flops=None, seconds=1.0, steps=1, wait=0.5)]
    text = summarise_windows(slow_data, window=1, warmup_steps=0, dtype="fp32", fit_tokens=1000, fit_flops=0.0)["text"]
    assert "raise the training DataLoader's num_workers" in text and "TextDataModule" not in text
    with command_line_options():
        text = summarise_windows(slow_data, window=1, warmup_steps=0, dtype="fp32", fit_tokens=1000, fit_flops=0.0,
                                 on_cuda=True, workers=f"the loader's workers ({option('TextDataModule', 'num_workers')})")["text"]
    assert "raise the loader's workers (--data.num_workers)" in text
    assert "add CUDASettings (init_args: {tf32: true} of CUDASettings in trainer.callbacks)" in text
    assert "--trainer.precision bf16-mixed" in text
