"""Where the ``gpuopt`` command takes each class's options, registered with ``option_checks`` at import.

``option_checks.option`` names a fix as the user writes it; inside the command that is the class's group
(``--model.learning_rate``) or its entry in a list option (``init_args... of Float8Precision in trainer.plugins``).
The command builds those groups, so it says where they are: the lower layer holds the table, the CLI fills it.
"""

from __future__ import annotations

from lightning.pytorch import Trainer

from lightning_gpuopt.callbacks import ExactResume, SigtermCheckpoint
from lightning_gpuopt.checkpoint.io import AtomicCheckpointIO
from lightning_gpuopt.data import TextDataModule
from lightning_gpuopt.model import GPTConfig, GPTModule
from lightning_gpuopt.option_checks import register_command_line_place
from lightning_gpuopt.precision import BF16Precision, Float8Precision

__all__ = ["OPTION_GROUPS", "PLUGIN_CLASSES"]

# A class -> its group of options in the command ("" for the top level: --ckpt_path).
OPTION_GROUPS: dict[object, str] = {
    GPTModule: "model",
    GPTConfig: "model",  # its fields are GPTModule's arguments
    TextDataModule: "data",
    Trainer: "trainer",
    "Trainer.fit": "",
    ExactResume: "exact_resume",
    SigtermCheckpoint: "sigterm_checkpoint",
}
PLUGIN_CLASSES = (BF16Precision, Float8Precision, AtomicCheckpointIO)  # entries of trainer.plugins

for _owner, _group in OPTION_GROUPS.items():
    register_command_line_place(_owner, group=_group)
for _plugin in PLUGIN_CLASSES:
    register_command_line_place(_plugin, listed_in="trainer.plugins")
