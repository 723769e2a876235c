"""Tokenizers: a literal special token in the text stays text; the separator comes only from document ends."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer

from lightning_gpuopt import TextDataModule
from lightning_gpuopt.data.tokenizer import EOT_TOKEN, carried_tokenizer, load_tokenizer, train_bpe_tokenizer

QUOTED = f"the tokenizer writes {EOT_TOKEN} between documents, and this line quotes it"


def test_a_literal_endoftext_in_the_corpus_is_text_not_the_separator(tmp_path, cache_dir):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    for i in range(3):  # 3 documents, each quoting the token 40 times
        (corpus / f"doc{i}.txt").write_text("\n".join([QUOTED] * 40) + "\n" + "plain words here " * 200)
    data = TextDataModule(source=str(corpus), block_size=16, batch_size=2, vocab_size=300, num_workers=0,
                          cache_dir=str(cache_dir))
    data.prepare_data()
    data.setup("fit")
    eot = data.tokenizer.token_to_id(EOT_TOKEN)
    tokens = np.fromfile(data.data_dir / "train.bin", dtype=data._meta["dtype"])  # every split: val and test are its tail
    assert int((tokens == eot).sum()) == 3  # one separator per document, none for the 120 quotes
    text = data.tokenizer.decode(tokens[tokens != eot].tolist())
    assert text.count(EOT_TOKEN) == 120  # the quotes are still there, as text
    assert eot not in data.encode(f"a prompt with {EOT_TOKEN} in it")  # prompts too


@pytest.mark.parametrize("route", ["trained", "loaded", "carried"])
def test_every_tokenizer_the_package_builds_or_reads_encodes_the_token_as_text(route, tmp_path):
    trained = train_bpe_tokenizer(["some text to learn from", QUOTED], vocab_size=280)
    if route == "loaded":
        trained.save(str(tmp_path / "tokenizer.json"))
        tokenizer = load_tokenizer(tmp_path / "tokenizer.json")
    elif route == "carried":
        tokenizer = carried_tokenizer({"tokenizer_json": trained.to_str()})
    else:
        tokenizer = trained
    eot = tokenizer.token_to_id(EOT_TOKEN)
    ids = tokenizer.encode(QUOTED).ids
    assert eot not in ids and tokenizer.decode(ids) == QUOTED
    assert Tokenizer.from_str(trained.to_str()).encode(QUOTED).ids != ids  # what tokenizers does without the setting
