"""Engine test helpers: a reference greedy decode, mixed prompt sets, a fake model, and a fault
injected into one request (`FailingRequest`)."""

from __future__ import annotations

import random

import torch


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat((ids, model(ids)[:, -1].argmax(-1, keepdim=True)), dim=1)
    return ids[0, len(prompt):].tolist()


def mixed_prompts(vocab: int, count: int = 16, seed: int = 0) -> list[list[int]]:
    """Mixed lengths (1-40), half of them sharing a 24-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(24)]
    prompts = []
    for i in range(count):
        tail = [rng.randrange(vocab) for _ in range(rng.randint(1, 16))]
        prompts.append(shared + tail if i % 2 else [rng.randrange(vocab) for _ in range(rng.randint(1, 40))])
    return prompts


def tiny_llm_tokens() -> str:
    """A tiny float32 GQA model's greedy tokens through LLMEngine, after "placed" or "not
    placed": whether the executor moved its weights (egmla.kernels.place_weights)."""
    from egmla.presets import preset
    from serve import EngineConfig, LLMEngine, SamplingParams
    from support.models import build

    model = build(preset("tiny-gqa2"), torch.float32)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64))
    tokens = engine.generate(mixed_prompts(model.config.vocab_size, count=4),
                             SamplingParams(temperature=0, max_tokens=8))
    placed = getattr(model, "_egmla_placed", None) is not None
    return f"{'placed' if placed else 'not placed'} {tokens}"


class HistorySumModel(torch.nn.Module):
    """A fake model for scheduler-only tests (nanochat's MockModel idea), cheap enough for
    thousands of requests, yet one that reads its whole history from the cache the engine hands
    it: its next token is (sum of every token so far + the last position) mod vocab. It caches
    each token's id as its one per-layer field, so a wrong block table, position or recompute
    after preemption gives a wrong token, and `history_sum_greedy` is its exact reference."""

    def __init__(self, vocab_size: int = 97, max_seq_len: int = 256) -> None:
        from types import SimpleNamespace

        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size, max_seq_len=max_seq_len,
                                      eos_token_id=None)
        self.tok_emb = torch.nn.Embedding(vocab_size, 1, dtype=torch.float64)  # dtype, device
        self.layers = torch.nn.ModuleList()  # no block for the executor's fused decode to run

    def cache_spec(self):
        from egmla.cache import CacheSpec, FieldSpec

        return CacheSpec(layers=({"token": FieldSpec((1,))},))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache=None,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """(B, vocab) logits at `logits_at`, or (B, T, vocab) at every position, as the real
        model returns them."""
        B, T = tokens.shape
        if cache is None:
            history, keys = tokens.double(), positions.expand(B, T)
        else:
            cache.begin({}, positions)
            view = cache.layer(0)
            history = view.update(token=tokens.double()[..., None])["token"][..., 0]
            keys = view.key_positions.expand(B, -1)
            cache.advance()
        if logits_at is None:
            return torch.stack([self._logits(positions, history, keys, torch.full((B,), t))
                                for t in range(T)], 1)
        return self._logits(positions, history, keys, logits_at)

    def _logits(self, positions, history, keys, last) -> torch.Tensor:
        B = last.shape[0]
        query = positions.expand(B, -1)[torch.arange(B), last]  # (B,) the position each row predicts from
        seen = (keys <= query[:, None]) & (keys >= 0)
        nxt = ((history * seen).sum(1).long() + query) % self.config.vocab_size
        return torch.nn.functional.one_hot(nxt, self.config.vocab_size).double() * 50.0


def history_sum_greedy(prompt: list[int], n: int, vocab_size: int = 97) -> list[int]:
    """`HistorySumModel`'s greedy continuation, computed in plain Python."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append((sum(tokens) + len(tokens) - 1) % vocab_size)
    return tokens[len(prompt):]


def run_ragged(model, sequences: list[torch.Tensor], block_size: int, seed: int, attention=None,
               dtype: torch.dtype = torch.float64):
    """Feed each sequence in random chunks, all rows in one ragged step at a time, through
    randomly scattered blocks of a `dtype` cache, attending through `attention` (a
    serve.attention backend; None: the default). Returns, per sequence, the logits of every
    position."""
    from serve.paged_cache import PagedKVCache

    rng = random.Random(seed)
    spec = model.cache_spec()
    need = sum(-(-len(s) // block_size) for s in sequences)
    cache = PagedKVCache(spec, num_blocks=need + 3, block_size=block_size, dtype=dtype,
                         attention=attention)
    ids = list(range(need + 3))
    rng.shuffle(ids)
    tables, done = [], [0] * len(sequences)
    for s in sequences:
        n = -(-len(s) // block_size)
        tables.append(ids[:n])
        ids = ids[n:]
    logits = [[] for _ in sequences]
    while any(d < len(s) for d, s in zip(done, sequences)):
        rows = [i for i, s in enumerate(sequences) if done[i] < len(s)]
        rows = rng.sample(rows, rng.randint(1, len(rows)))  # not every sequence every step
        new = [rng.randint(1, len(sequences[i]) - done[i]) if rng.random() < 0.5 else 1
               for i in rows]
        T = max(new)
        tokens = torch.zeros(len(rows), T, dtype=torch.long)
        positions = torch.zeros(len(rows), T, dtype=torch.long)  # padding queries sit at 0
        for b, (i, n) in enumerate(zip(rows, new)):
            tokens[b, :n] = sequences[i][done[i] : done[i] + n]
            positions[b, :n] = torch.arange(done[i], done[i] + n)
        step = cache.step([tables[i] for i in rows], [done[i] for i in rows], new)
        with torch.no_grad():
            out = model(tokens, positions, cache=step)
        for b, (i, n) in enumerate(zip(rows, new)):
            logits[i].append(out[b, :n])
            done[i] += n
    return [torch.cat(chunks) for chunks in logits]


class FailingRequest:
    """A fault injected into one request of a live engine, for the failure-isolation tests (a
    hook on this engine instance only: nothing a client could set). The request is the one
    whose prompt is `prompt`; once it has generated `after` tokens, every step of it fails:

    - where="forward": a forward over rows that include one of its rows first runs the model on
      scrambled tokens, writing wrong K/V into the new-token slots of every row of that batch
      (what a forward dying midway may leave behind), then raises;
    - where="sample": drawing its next token raises.

    `fired` records, for each injected fault, how many rows the forward (or the step) held, so a
    test can show that other requests were in the batch that failed."""

    def __init__(self, engine, prompt: list[int], where: str, after: int = 0) -> None:
        if where not in ("forward", "sample"):
            raise ValueError(f"where={where!r}: 'forward' or 'sample'")
        self.engine, self.prompt, self.after, self.where = engine, list(prompt), after, where
        self.fired: list[int] = []
        self._original = getattr(engine, "_" + where)
        setattr(engine, "_" + where, self._forward if where == "forward" else self._sample)

    def remove(self) -> None:
        delattr(self.engine, "_" + self.where)  # the class's method again

    def _targets(self, seq) -> bool:
        return seq.prompt == self.prompt and len(seq.output) >= self.after

    def _forward(self, rows, every: bool = False):
        if not any(self._targets(self.engine.sequence(r.seq_id)) for r in rows):
            return self._original(rows, every)
        model, vocab = self.engine.model, self.engine.model.config.vocab_size
        model.forward = lambda tokens, *args, **kw: type(model).forward(
            model, (tokens * 7 + 3) % vocab, *args, **kw)
        try:
            self._original(rows, every)  # a whole forward, over the wrong tokens
        finally:
            del model.forward
        self.fired.append(len(rows))
        raise RuntimeError(f"injected fault in the forward of {len(rows)} row(s)")

    def _sample(self, seq, logits, greedy=None):
        if self._targets(seq):
            self.fired.append(len(self.engine.last_plan.rows))
            raise RuntimeError("injected fault in sampling")
        return self._original(seq, logits, greedy)


def assert_ragged_native_equals_full_forward(model, dtype: torch.dtype, tolerance: float,
                                             seed: int = 3) -> None:
    """Five sequences (lengths 5, 13, 9, 17, 1) in ragged chunked steps through scattered blocks
    under the native backend: every position's logits equal the model's own full forward, to
    `tolerance` of its largest logit (bf16: both round, differently)."""
    from serve import attention

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    sequences = [torch.randint(0, vocab, (n,), generator=g) for n in (5, 13, 9, 17, 1)]
    got = run_ragged(model, sequences, block_size=4, seed=0, attention=attention.Native(),
                     dtype=dtype)
    for s, logits in zip(sequences, got):
        with torch.no_grad():
            expected = model(s[None])[0]
        scale = expected.abs().max().item()
        assert (logits.float() - expected.float()).abs().max().item() <= tolerance * scale


def greedy_by_backend(model, backends=("native", "sdpa")) -> tuple[dict, dict]:
    """Greedy tokens of `mixed_prompts` through an engine per attention backend, continuous
    batching with prefix caching on: (outputs, prompt tokens served from the prefix cache),
    each by backend."""
    from serve import SamplingParams
    from serve.engine import EngineConfig, LLMEngine

    prompts = mixed_prompts(model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=8)
    outs, cached = {}, {}
    for backend in backends:
        engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=128,
                                               attention_backend=backend,
                                               enable_prefix_caching=True))
        outs[backend] = engine.generate(prompts, params)
        cached[backend] = engine.stats.cached_prompt_tokens
    return outs, cached
