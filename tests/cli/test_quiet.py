"""``quiet_lightning``: Lightning's advertisements and unactionable warnings are left out of a ``gpuopt`` run."""

from __future__ import annotations

import logging

import lightning.pytorch as pl

from lightning_gpuopt.cli.quiet import quiet_lightning


def _tips(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "Tip:" in r.getMessage()]


def test_lightnings_tips_are_left_out_inside_and_come_back_after(caplog, tmp_path):
    caplog.set_level(logging.INFO)
    # No ModelCheckpoint listed: Lightning adds its own and advertises another (--trainer.callbacks X replaces
    # the list of the default stack, so a gpuopt run can meet this).
    build = dict(default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False)
    with quiet_lightning():
        trainer = pl.Trainer(**build)
        trainer._callback_connector._maybe_show_litmodels_tip()  # what fit does once the loggers are set up
    assert _tips(caplog) == []
    trainer = pl.Trainer(**build)  # outside: Lightning's own behaviour is untouched
    trainer._callback_connector._maybe_show_litmodels_tip()
    said = " ".join(_tips(caplog))
    assert "cloud logging" in said and "cloud uploads" in said
