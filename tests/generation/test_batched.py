"""Continuous batching: mixed-length prompts get exactly what they would alone (greedy), rows end at end-of-text or a
stop sequence, finished rows are refilled so the batch stays full; the padded forward and the per-row KV cache."""

from types import SimpleNamespace

import pytest
import torch

from lightning_gpuopt.generation import KVCache
from lightning_gpuopt.model import GPT, GPTConfig
from lightning_gpuopt.generation.batched import GenerationJob, Request, fit_to_context, generate_batched


def _model(**overrides) -> GPT:
    torch.manual_seed(0)
    config = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=96)
    return GPT(GPTConfig(**{**config, **overrides})).eval()


def _requests(n: int = 8, seed: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 14, (n,), generator=g).tolist()
    budgets = torch.randint(1, 12, (n,), generator=g).tolist()
    return [Request(torch.randint(0, 96, (L,), generator=g).tolist(), m, key=i) for i, (L, m) in enumerate(zip(lengths, budgets))]


@pytest.fixture(scope="module")
def greedy_alone() -> dict:
    """Each request's greedy tokens from GPT.generate on its prompt alone (computed once for the module)."""
    model = _model()
    return {r.key: _alone(model, r) for r in _requests()}


def _alone(model: GPT, request: Request) -> list[int]:
    prompt = torch.tensor([request.ids])
    return model.generate(prompt, request.max_new_tokens, temperature=0)[0, prompt.size(1):].tolist()


class _HFStyle(torch.nn.Module):
    """A module called as Hugging Face's are: input_ids, attention_mask, position_ids; logits in an output object."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt
        self.config = SimpleNamespace(vocab_size=gpt.config.vocab_size, max_position_embeddings=gpt.config.block_size)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return SimpleNamespace(logits=self.gpt(input_ids, input_pos=position_ids, key_padding_mask=attention_mask.bool()))


@pytest.mark.parametrize("how, batch_size", [("kv-cache", 1), ("kv-cache", 3), ("kv-cache", 8), ("no-cache", 3), ("hf-style", 3)])
def test_greedy_rows_equal_one_prompt_at_a_time(batch_size, how, greedy_alone):
    """Prompts of 1-13 tokens with 1-11 new tokens each, left-padded together, refilled as rows finish: every row's
    tokens are those of GPT.generate on its prompt alone."""
    model = _model()
    requests = _requests()
    target = _HFStyle(model) if how == "hf-style" else model
    out = {d.key: d for d in generate_batched(target, requests, batch_size, temperature=0, use_cache=None if how != "no-cache" else False)}
    assert sorted(out) == list(range(len(requests)))
    for request in requests:
        assert out[request.key].tokens == greedy_alone[request.key], request.key
        assert out[request.key].reason == "length"


@pytest.mark.parametrize("how", ["kv-cache", "no-cache"])
def test_llama_style_greedy_rows_equal_one_prompt_at_a_time(how):
    """The same with rotary positions per row and grouped key/value heads in the cache."""
    model = _model(arch="llama", n_head=4, n_kv_head=2, n_embd=64)
    requests = _requests(6, seed=1)
    out = {d.key: d.tokens for d in generate_batched(model, requests, 3, temperature=0, use_cache=None if how == "kv-cache" else False)}
    assert out == {r.key: _alone(model, r) for r in requests}


def test_padded_forward_gives_each_row_its_own_logits():
    model = _model()
    prompts = [torch.randint(0, 96, (n,)) for n in (3, 9, 5)]
    ids = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros(3, 9, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, 9 - len(p):], mask[b, 9 - len(p):] = p, True
    caches = [KVCache(32) for _ in range(2)]
    with torch.no_grad():
        padded = model(ids, key_padding_mask=mask)
        cached = model(ids, caches, key_padding_mask=mask)
        step = model(torch.tensor([[5], [6], [7]]), caches)  # one more token per row, rows at different positions
        for b, p in enumerate(prompts):
            torch.testing.assert_close(padded[b, 9 - len(p):], model(p[None])[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cached[b, 9 - len(p):], model(p[None])[0], atol=1e-5, rtol=1e-5)
            alone = model(torch.cat([p, torch.tensor([5 + b])])[None])[0, -1]
            torch.testing.assert_close(step[b, 0], alone, atol=1e-5, rtol=1e-5)
    assert caches[0].seen.tolist() == [4, 10, 6] and caches[0]._lengths == [10, 10, 10]


def test_rows_end_at_end_of_text_or_a_stop_sequence_which_are_left_out(greedy_alone):
    model = _model()
    requests = _requests()
    alone = greedy_alone
    long_ones = [r for r in requests if len(alone[r.key]) >= 4]
    eot = alone[long_ones[0].key][2]  # the third token of one row's greedy answer: that row ends there
    stop = alone[long_ones[1].key][1:3]  # two tokens of another's
    out = {d.key: d for d in generate_batched(model, requests, 3, temperature=0, eot_id=eot, stop_sequences=[stop])}
    for r in requests:
        expected, reason = alone[r.key], "length"
        if eot in expected:
            expected, reason = expected[: expected.index(eot)], "eot"
        for i in range(len(expected) - 1):
            if expected[i : i + 2] == stop:
                expected, reason = expected[:i], "stop"
                break
        assert (out[r.key].tokens, out[r.key].reason) == (expected, reason), r.key
    assert out[long_ones[0].key].reason == "eot"


def test_a_stop_string_inside_a_token_or_across_two_ends_the_row(greedy_alone):
    """A stop string matched on the text: inside a longer token (as "\\n" in a "\\n    " token of a byte-level BPE) or
    split over two tokens, which token ids never match; the row stops at the token the text ends in."""
    model = _model()
    requests = _requests()
    text = {i: "abcdefghijklmnopqrstuvwxyz"[i % 26] * (1 + i % 3) for i in range(96)}  # tokens of 1 to 3 letters
    decode = lambda ids: "".join(text[i] for i in ids)  # noqa: E731
    long_ones = [r for r in requests if len(greedy_alone[r.key]) >= 3]
    a, b = greedy_alone[long_ones[0].key][1:3]
    across = text[a][-1] + text[b][0]  # the end of one token and the start of the next
    inside = text[greedy_alone[long_ones[1].key][2]][:1]  # one letter of a longer token
    stops = [across, inside]
    out = {d.key: d for d in generate_batched(model, requests, 3, temperature=0, stop_strings=stops, decode=decode)}
    for r in requests:
        alone = greedy_alone[r.key]
        end = next((k for k in range(1, len(alone) + 1) if any(s in decode(alone[:k]) for s in stops)), None)
        expected = (alone, "length") if end is None else (alone[:end], "stop")
        assert (out[r.key].tokens, out[r.key].reason) == expected, r.key
    assert out[long_ones[0].key].reason == out[long_ones[1].key].reason == "stop"
    with pytest.raises(ValueError, match="pass decode"):
        next(generate_batched(model, requests, 3, stop_strings=["a"]))


def test_finished_rows_are_refilled_so_the_batch_stays_full():
    """14 prompts of 2-9 tokens with 2-12 new tokens, batch of 4: every decode step runs 4 rows as long as a prompt
    waits (a finished row's place is refilled at once), and the batch shrinks only once the queue is empty."""
    model = _model()
    g = torch.Generator().manual_seed(1)
    lengths, budgets = torch.randint(2, 10, (14,), generator=g).tolist(), torch.randint(2, 13, (14,), generator=g).tolist()  # 9 + 12 < 32
    requests = [Request(torch.randint(0, 96, (n,), generator=g).tolist(), m, key=i) for i, (n, m) in enumerate(zip(lengths, budgets))]
    events: list = []
    model.register_forward_hook(lambda module, args, out: events.append(("forward", tuple(args[0].shape))))

    def queue():
        for r in requests:
            events.append(("take", r.key))
            yield r

    out = {d.key: d.tokens for d in generate_batched(model, queue(), 4, temperature=0)}
    assert all(len(out[r.key]) == r.max_new_tokens for r in requests)
    last_take = max(i for i, e in enumerate(events) if e[0] == "take")
    decodes = [(i, shape[0]) for i, (kind, shape) in enumerate(events) if kind == "forward" and shape[1] == 1]
    assert [rows for i, rows in decodes if i < last_take] == [4] * len([i for i, _ in decodes if i < last_take])
    after = [rows for i, rows in decodes if i > last_take]
    assert after == sorted(after, reverse=True) and after[-1] == 1  # the tail shrinks to the longest row
    # one forward per new token of the busiest path, not one per batch of equal-length prompts run to the longest
    assert len(decodes) < sum(budgets) / 4 + max(budgets)


def test_kv_cache_rows_load_and_leave():
    cache = KVCache(8)
    k = torch.arange(2 * 1 * 3 * 2, dtype=torch.float).view(2, 1, 3, 2)
    cache.update(k, k + 100)
    other = KVCache(4)
    other.update(torch.full((1, 1, 2, 2), -1.0), torch.full((1, 1, 2, 2), -2.0), torch.tensor([[False, True]]))
    cache.load_rows([1], other, 2)
    assert cache._lengths == [3, 2] and cache.seen.tolist() == [3, 1] and not cache.dense
    assert cache.valid[1].tolist() == [False, True] + [False] * 6
    assert torch.equal(cache.k[1, :, :2], torch.full((1, 2, 2), -1.0)) and torch.equal(cache.k[0, :, :3], k[0])
    cache.keep([1])
    assert cache._lengths == [2] and cache.k.shape[0] == 1 and torch.equal(cache.v[0, :, :2], torch.full((1, 2, 2), -2.0))


def test_fit_to_context():
    assert fit_to_context(10, 20, 48) == 10
    assert fit_to_context(40, 20, 48) == 28  # the prompt's last 28 tokens
    assert fit_to_context(40, 47, 48) == 1
    with pytest.raises(ValueError, match=r"max_new_tokens=48 does not fit in the model's context of block_size=48 .*at most 47"):
        fit_to_context(1, 48, 48)


@pytest.mark.parametrize(
    "requests, kwargs, match",
    [
        ([Request([], 3, key="a")], {}, "Request 'a' has an empty prompt"),
        ([Request([1] * 30, 10, key="b")], {}, r"Request 'b': a prompt of 30 tokens and 10 new tokens do not fit in the model's context of 32"),
        ([Request([1], 3)], {"stop_sequences": [[]]}, "A stop sequence has no tokens"),
        ([Request([1], 3)], {"batch_size": 0}, "generate_batched.batch_size must be an integer >= 1, got 0"),
    ],
)
def test_bad_requests(requests, kwargs, match):
    with pytest.raises(ValueError, match=match):
        list(generate_batched(_model(), requests, **{"batch_size": 2, **kwargs}))


def test_a_module_without_an_attention_mask_is_refused():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 2)

        def forward(self, input_ids):
            return input_ids

    with pytest.raises(ValueError, match="takes no attention mask .*cannot share a batch"):
        list(generate_batched(Plain(), [Request([1], 1)], 2))


def test_generation_job_is_left_alone_by_lightnings_batch_transfer():
    from lightning.fabric.utilities.apply_func import move_data_to_device

    job = GenerationJob([Request([1, 2], 3)], on_finished=print)
    assert move_data_to_device(job, torch.device("cpu")) is job


def test_samples_of_a_prompt_share_its_prefill_and_draw_their_own_tokens(greedy_alone):
    model = _model()
    prompts = _requests()[:3]
    shapes: list = []
    model.register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)))
    rows = [Request(r.ids, 6, key=(r.key, s)) for r in prompts for s in range(4)]
    sampled = {d.key: d.tokens for d in generate_batched(model, rows, 12, temperature=1.0, generator=torch.Generator().manual_seed(0))}
    assert shapes[0] == (3, max(len(r.ids) for r in prompts))  # one prefill row per prompt, not per sample
    for r in prompts:
        assert len({tuple(sampled[(r.key, s)]) for s in range(4)}) > 1  # each sample draws its own tokens
    greedy = {d.key: d.tokens for d in generate_batched(model, rows, 12, temperature=0)}
    assert all(greedy[(r.key, s)] == greedy_alone[r.key][:6] for r in prompts for s in range(4))
