import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_train_wikitext_script_trains(tmp_path, text_dir, cache_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import train_wikitext

    trainer = train_wikitext.main(
        ["--data_dir", str(text_dir), "--max_steps", "4", "--d_model", "64", "--num_layers", "2", "--num_heads", "4",
         "--block_size", "32", "--vocab_size", "300", "--batch_size", "4", "--gradient_accumulation_steps", "2",
         "--mixed_precision", "bf16", "--num_workers", "0", "--checkpoint_dir", str(tmp_path / "ckpt")]
    )
    sys.modules.pop("train_wikitext", None)
    assert trainer.global_step == 4 and trainer.accumulate_grad_batches == 2
    assert trainer.lightning_module.config.n_embd == 64
    assert (tmp_path / "ckpt" / "last.ckpt").is_file()
