"""Continuous batching: prompts of any length share a batch, each row stops at its own end, and a finished
row's place takes the next waiting prompt, so the batch stays full until the queue is empty.

A ``GPT``-like model (``forward(idx, caches, ..., key_padding_mask)``) runs with a KV cache; a module taking an
``attention_mask`` (Hugging Face style) runs each row's whole left-padded context every step. How, and the
limits: ``docs/generation.md``."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_gpuopt.generation.sampling import sample_next
from lightning_gpuopt.generation.kv_cache import KVCache
from lightning_gpuopt.option_checks import check_int, check_number

__all__ = ["Finished", "GenerationJob", "Request", "fit_to_context", "generate_batched"]

# Idle rows are refilled once they are 1/8 of the batch (or all of it, or one would outgrow the context): each refill
# is a prefill forward, so a few at a time cost fewer forwards than one per finished row.
REFILL_FRACTION = 8

PREFILL_LOGITS_BYTES = 1 << 30  # most bytes of float32 logits one prefill forward may produce


@dataclass(frozen=True)
class Request:
    """One row to generate."""

    ids: Sequence[int]  # the prompt's token ids (at least one)
    max_new_tokens: int  # len(ids) + max_new_tokens must fit in the context
    key: Any = None  # the caller's handle, returned with the result, e.g. (prompt index, sample index)


@dataclass
class Finished:
    """A finished row."""

    key: Any  # the request's key
    tokens: list[int] = field(default_factory=list)  # new token ids, without the end-of-text or stop sequence (a stop
    # string found in the text keeps the token it ends in: cut the decoded text at it)
    reason: str = "length"  # "eot", "stop" (a stop sequence) or "length" (max_new_tokens)


class GenerationJob:
    """The one batch of a continuous generation run through ``trainer.predict``: ``GPTModule.predict_step`` generates
    every request with :func:`generate_batched` and hands each finished row to ``on_finished``.

    A plain class, so Lightning's transfer of a batch to the device leaves it as it is.

    Example::

        job = GenerationJob(requests, on_finished=results.append, eot_id=eot)
        trainer.predict(module, dataloaders=DataLoader([job], batch_size=None, collate_fn=lambda job: job))

    Args:
        requests: The rows to generate.
        on_finished: Called with each :class:`Finished` row, as it finishes.
        batch_size: Rows at a time; ``None``: the largest the device's memory allows (``generation_batch_size``).
        eot_id: The end-of-text token id (``None``: rows end only at a stop sequence or their length).
        stop_sequences: Token-id sequences that end a row.
        on_step: Called after each forward with the tokens it sampled.
        stop_strings: Text that ends a row wherever the tokens put it (with ``decode``).
        decode: Token ids to text, for ``stop_strings``.
    """

    def __init__(
        self,
        requests: Sequence[Request],
        on_finished: Callable[[Finished], None],
        batch_size: Optional[int] = None,
        eot_id: Optional[int] = None,
        stop_sequences: Sequence[Sequence[int]] = (),
        on_step: Optional[Callable[[int], None]] = None,
        stop_strings: Sequence[str] = (),
        decode: Optional[Callable[[list[int]], str]] = None,
    ) -> None:
        self.requests = list(requests)
        self.on_finished = on_finished
        self.batch_size = batch_size
        self.eot_id = eot_id
        self.stop_sequences = [list(s) for s in stop_sequences]
        self.on_step = on_step
        self.stop_strings = list(stop_strings)
        self.decode = decode


def fit_to_context(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """How many of a prompt's last tokens generation keeps so that ``max_new_tokens`` (below ``block_size``) fit
    after them."""
    if max_new_tokens >= block_size:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} does not fit in the model's context of block_size={block_size} tokens, "
            f"prompt included: ask for at most {block_size - 1} (e.g. {block_size // 2}); a row also ends at "
            "end-of-text or a stop sequence."
        )
    return min(prompt_len, block_size - max_new_tokens)


class _Row:
    __slots__ = ("request", "tokens")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.tokens: list[int] = []


class _Caller:
    """How to call ``model``: its context, vocabulary, and whether it takes a KV cache or an attention mask."""

    def __init__(self, model: nn.Module, use_cache: Optional[bool]) -> None:
        params = inspect.signature(model.forward).parameters
        config = getattr(model, "config", None)
        self.model = model
        self.ours = "key_padding_mask" in params
        self.cached = (
            self.ours and "caches" in params and hasattr(config, "n_layer") if use_cache is None else use_cache
        )
        if self.cached and not (self.ours and "caches" in params):
            raise ValueError("generate_batched(use_cache=True) needs a GPT-like model taking caches; "
                             f"{type(model).__name__} does not.")
        if not self.ours and "attention_mask" not in params:
            raise ValueError(
                f"{type(model).__name__}.forward takes no attention mask (key_padding_mask or attention_mask), so "
                "prompts of different lengths cannot share a batch: give it one, or generate one prompt at a time."
            )
        self.position_ids = "position_ids" in params
        names = ("block_size", "max_position_embeddings", "n_positions")
        self.block_size: Optional[int] = next(
            (getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None
        )
        self.vocab_size: Optional[int] = getattr(config, "vocab_size", None)
        self.n_layer: int = getattr(config, "n_layer", 0)
        self.device = next(model.parameters()).device

    def logits(self, idx: Tensor, mask: Optional[Tensor], caches: Optional[list[KVCache]] = None) -> Tensor:
        """Next-token logits (B, vocab_size) after the last column of ``idx`` (B, T); ``mask`` (B, T) bool or
        ``None``."""
        if self.ours:
            out = self.model(idx, caches, key_padding_mask=mask)
        else:
            mask = torch.ones_like(idx, dtype=torch.bool) if mask is None else mask
            kwargs: dict[str, Any] = {"attention_mask": mask.long()}
            if self.position_ids:
                kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
            out = self.model(input_ids=idx, **kwargs)
        out = out if isinstance(out, Tensor) else out[0] if isinstance(out, (tuple, list)) else out.logits
        return out[:, -1, : self.vocab_size]  # the embedding's padding rows are never produced


def _left_padded(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, Optional[Tensor]]:
    """(B, T) ids, left-padded with 0 to the longest, and the (B, T) mask of real tokens (``None``: no padding)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        mask[b, width - len(p) :] = True
    return ids.to(device), (None if bool(mask.all()) else mask.to(device))


class _Stops:
    """Whether a row ends after a new token: end-of-text, a stop sequence, or its length."""

    def __init__(self, eot_id: Optional[int], stop_sequences: Sequence[Sequence[int]], stop_strings: Sequence[str] = (),
                 decode: Optional[Callable[[list[int]], str]] = None) -> None:
        for s in stop_sequences:
            if len(s) == 0:
                raise ValueError("A stop sequence has no tokens: give each stop sequence some text (or leave it out).")
        if any(stop_strings) and decode is None:
            raise ValueError("stop_strings are matched on the decoded text: pass decode (token ids -> text) too.")
        self.eot_id = eot_id
        self.sequences = [list(s) for s in stop_sequences]
        self.strings = [s for s in stop_strings if s]
        self.decode = decode
        # A stop string of n bytes that ends in the newest token lies within the last n tokens (each has a byte).
        self.window = max((len(s.encode()) for s in self.strings), default=0)
        self._chars = set("".join(self.strings)) | {"\ufffd"}  # a token holding a part of a character may too
        self._touches: dict[int, bool] = {}  # token id -> whether its text holds a character of a stop string

    def _in_text(self, tokens: list[int]) -> bool:
        """Whether a stop string ends in the text of the newest token (decoded only if that token could end one)."""
        token = tokens[-1]
        if token not in self._touches:
            self._touches[token] = not self._chars.isdisjoint(self.decode([token]))
        return self._touches[token] and any(s in self.decode(tokens[-self.window :]) for s in self.strings)

    def add(self, row: _Row, token: int) -> Optional[str]:
        """Append ``token`` to ``row``; the reason it ends, or ``None``."""
        if token == self.eot_id:
            return "eot"
        row.tokens.append(token)
        for s in self.sequences:
            if row.tokens[-len(s) :] == s:
                del row.tokens[-len(s) :]
                return "stop"
        if self.strings and self._in_text(row.tokens):
            return "stop"
        return "length" if len(row.tokens) >= row.request.max_new_tokens else None


@torch.no_grad()
def generate_batched(
    model: nn.Module,
    requests: Iterable[Request],
    batch_size: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    eot_id: Optional[int] = None,
    stop_sequences: Sequence[Sequence[int]] = (),
    generator: Optional[torch.Generator] = None,
    use_cache: Optional[bool] = None,
    on_step: Optional[Callable[[int], None]] = None,
    stop_strings: Sequence[str] = (),
    decode: Optional[Callable[[list[int]], str]] = None,
) -> Iterator[Finished]:
    """Generate every request, ``batch_size`` rows at a time, yielding each row as it finishes (not in request order).

    Example::

        requests = [Request(tokenizer.encode(p).ids, 128, key=i) for i, p in enumerate(prompts)]  # any lengths
        for done in generate_batched(model.eval(), requests, batch_size=64, temperature=0.7, eot_id=eot):
            print(done.key, tokenizer.decode(done.tokens), done.reason)

    Args:
        model: A ``GPT`` (KV cache), or a module taking ``attention_mask``, in ``eval()`` mode.
        requests: The rows to generate; read as rows free up, each checked then.
        batch_size: Most rows at a time.
        temperature: Sampling temperature; ``0`` is greedy.
        top_k: Sample among the ``top_k`` most likely tokens only.
        eot_id: The end-of-text token: a row that samples it ends (``None``: none).
        stop_sequences: Token-id sequences that end a row when its new tokens end with one.
        generator: Random generator of the samples (one for the whole batch).
        use_cache: Use a KV cache (``None``: when the model takes one).
        on_step: Called after each forward with the number of tokens it sampled (for a progress bar).
        stop_strings: Text that ends a row when the decoded new tokens hold it: a stop inside a longer token, or
            split over two, which ``stop_sequences`` (token ids) miss. The row keeps the token the text ends in.
        decode: Token ids to text (needed with ``stop_strings``).

    Raises:
        ValueError: A bad argument, an empty prompt, or a prompt whose ``max_new_tokens`` do not fit in the
            model's context (checked as each request is read, before it is generated).
    """
    check_int("generate_batched", "batch_size", batch_size, minimum=1)
    check_number("generate_batched", "temperature", temperature, low=0, hint=" (0 is greedy)")
    check_int("generate_batched", "top_k", top_k, minimum=1, optional=True, hint=" (None: no limit)")
    caller = _Caller(model, use_cache)
    stops = _Stops(eot_id, stop_sequences, stop_strings, decode)

    def sample(logits: Tensor) -> tuple[Tensor, list[int]]:
        """(B, 1) token ids on the device, and the same ids on the host (the one wait per step)."""
        if on_step is not None:
            on_step(logits.size(0))
        picked = sample_next(logits, temperature, top_k, generator)
        return picked, picked.view(-1).tolist()

    pending = (_checked(r, caller.block_size) for r in requests)
    run = _run_cached if caller.cached else _run_uncached
    yield from run(caller, pending, batch_size, stops, sample)


def _checked(request: Request, block_size: Optional[int]) -> _Row:
    if len(request.ids) == 0:
        raise ValueError(f"Request {request.key!r} has an empty prompt: give each prompt at least one token.")
    if request.max_new_tokens < 1:
        raise ValueError(f"Request {request.key!r} asks for max_new_tokens={request.max_new_tokens}: give at least 1.")
    if block_size is not None and len(request.ids) + request.max_new_tokens > block_size:
        raise ValueError(
            f"Request {request.key!r}: a prompt of {len(request.ids)} tokens and {request.max_new_tokens} new tokens "
            f"do not fit in the model's context of {block_size}: shorten the prompt or ask for fewer new tokens."
        )
    return _Row(request)


def _take(pending: Iterator[_Row], n: int) -> list[_Row]:
    """Up to ``n`` rows from ``pending``."""
    rows: list[_Row] = []
    if n < 1:
        return rows
    for row in pending:
        rows.append(row)
        if len(rows) == n:
            break
    return rows


def _prefill_group(caller: _Caller, rows: list[_Row]) -> int:
    """How many of ``rows`` (from the first) to prefill in one forward: left-padded to the longest, each still fits in
    the context, and the float32 logits stay under ``PREFILL_LOGITS_BYTES``."""
    vocab = caller.vocab_size or 1
    width = most_new = 0
    for n, row in enumerate(rows):
        width, most_new = max(width, len(row.request.ids)), max(most_new, row.request.max_new_tokens)
        too_long = caller.block_size is not None and width + most_new > caller.block_size
        if n and (too_long or 4 * (n + 1) * width * vocab > PREFILL_LOGITS_BYTES):
            return n
    return len(rows)


def _run_cached(
    caller: _Caller,
    pending: Iterator[_Row],
    batch_size: int,
    stops: _Stops,
    sample: Callable[[Tensor], tuple[Tensor, list[int]]],
) -> Iterator[Finished]:
    # long: one loop owns the batch's rows, its caches and its last tokens; cut up, it would hide which row is where
    device, n_layer, block_size = caller.device, caller.n_layer, caller.block_size
    new = _take(pending, batch_size)  # the first prompts set the batch's rows
    capacity = len(new)
    waiting = capacity == batch_size  # whether prompts may still wait
    if capacity == 0:
        return
    refill_at = max(1, capacity // REFILL_FRACTION)
    caches = [KVCache(block_size) for _ in range(n_layer)]  # row b of every cache is rows[b]; None rows are idle
    rows: list[Optional[_Row]] = [None] * capacity
    last = torch.zeros(capacity, 1, dtype=torch.long, device=device)  # (B, 1): each row's token to feed next
    while True:
        free = [b for b, row in enumerate(rows) if row is None]
        # Refill idle rows in groups (one prefill forward costs about a decode step), before an idle row, still
        # decoded, would outgrow the context, and whenever the whole batch is idle.
        full = free and max(caches[0]._lengths[b] for b in free) + 1 >= block_size if caches[0].k is not None else False
        if waiting and free and not new and (len(free) >= refill_at or full or len(free) == capacity):
            new = _take(pending, len(free))
            waiting = len(new) == len(free)
        while new:  # prefill new prompts into free rows; a row that ends at once gives its place to the next prompt
            n = _prefill_group(caller, new)
            group, new = new[:n], new[n:]
            # Rows of one prompt (its samples) admitted together share one prefill: its cache rows are copied
            unique: dict[tuple[int, ...], int] = {}
            source = [unique.setdefault(tuple(r.request.ids), len(unique)) for r in group]  # group row -> prompt
            ids, mask = _left_padded(list(unique), device)  # (U, W)
            fresh = [KVCache(ids.size(1)) for _ in range(n_layer)]
            picked, first = sample(caller.logits(ids, mask, fresh)[source])  # (G, V): each row draws its own
            placed, slots = [], []
            for g, (row, token) in enumerate(zip(group, first)):
                reason = stops.add(row, token)
                if reason is not None:
                    yield Finished(row.request.key, row.tokens, reason)
                    more = _take(pending, 1) if waiting else []
                    waiting = waiting and bool(more)
                    new.extend(more)
                    continue
                slot = free.pop(0)
                rows[slot] = row
                placed.append(g)
                slots.append(slot)
            if placed:
                for cache, part in zip(caches, fresh):
                    part.keep([source[g] for g in placed])  # a prompt's rows once per sample placed
                    cache.load_rows(slots, part, capacity)
                last[slots] = picked[placed]
        if free and not waiting:  # no prompt waits: the idle rows leave the batch
            stay = [b for b, row in enumerate(rows) if row is not None]
            if not stay:
                return
            for cache in caches:
                cache.keep(stay)
            rows, last, capacity = [rows[b] for b in stay], last[stay], len(stay)
        last, tokens = sample(caller.logits(last, None, caches))  # one token for every row (idle ones too)
        for b, (row, token) in enumerate(zip(rows, tokens)):
            reason = None if row is None else stops.add(row, token)
            if reason is not None:
                yield Finished(row.request.key, row.tokens, reason)
                rows[b] = None


def _run_uncached(
    caller: _Caller,
    pending: Iterator[_Row],
    batch_size: int,
    stops: _Stops,
    sample: Callable[[Tensor], tuple[Tensor, list[int]]],
) -> Iterator[Finished]:
    rows = _take(pending, batch_size)
    while rows:
        ids, mask = _left_padded([[*r.request.ids, *r.tokens] for r in rows], caller.device)  # (B, T) whole contexts
        _, tokens = sample(caller.logits(ids, mask))
        going = []
        for row, token in zip(rows, tokens):
            reason = stops.add(row, token)
            if reason is None:
                going.append(row)
            else:
                yield Finished(row.request.key, row.tokens, reason)
        rows = going + _take(pending, batch_size - len(going))
