"""A continuous-batching engine over the paged KV cache; the vLLM-shaped API (serve/llm.py) and
the HTTP server (serve/server.py) build on it.

A step: the scheduler plans it (serve/scheduler.py: a `SchedulerOutput` value), the executor
runs the plan's rows as a few ragged forwards (serve/executor.py), the sampler draws each
row's next token (serve/sampling.py), and the engine applies the results to its sequences
(serve/request.py), counts them (serve/metrics.py) and finishes the ones that stop. A failure
ends only the requests it concerns (`step`).

Callers above the engine (serve/outputs.py, serve/llm.py, serve/async_engine.py) use its face
only: `check_request`, `add_request`, `step`, `samples`, `stop_sample`, `abort`, `fail`,
`is_finished`, `release`, `metrics` and `snapshot`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from egmla.models import Transformer
from serve import config as engine_config
from serve.block_manager import BlockManager
from serve.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig, kv_memory_for_share
from serve.executor import Executor, compiled_decode, forward_groups
from serve.metrics import EngineMetrics, EngineStats, PoolNow
from serve.request import Sequence
from serve.sampling import (MAX_LOGPROBS, RANGES, SEED_RANGE, InvalidRequest, SamplingParams,
                            greedy_tokens, is_int, is_plain_greedy, new_generator, sample_token,
                            sampling_scores)
from serve.scheduler import ScheduledRow, Scheduler, SchedulerOutput

# Names that moved out of this module in issue 40, still importable from it.
__all__ = ["DEFAULT_KV_CACHE_MEMORY", "MAX_LOGPROBS", "RANGES", "SEED_RANGE", "EngineConfig",
           "EngineMetrics", "InvalidRequest", "LLMEngine", "SamplingParams", "ScheduledRow",
           "SchedulerOutput", "Sequence", "StepFailed", "compiled_decode", "kv_memory_for_share",
           "sampling_scores"]

log = logging.getLogger("serve")


class StepFailed(RuntimeError):
    """Requests of a step failed: each (`reasons`: request id -> "ExceptionType: message") ended
    with finish_reason "error" and its blocks were freed, while the step's other requests went
    on. `request_ids` lists the failed ones, `reason` the first one's reason; the first
    exception is `__cause__`. A `generate` call (`LLMEngine.generate`, `LLM.generate`) runs its
    other requests to the end before raising it, with `outputs`: every prompt's result in
    order, None for a failed one."""

    def __init__(self, reasons: dict[int, str], outputs: list | None = None) -> None:
        self.reasons, self.outputs = dict(reasons), outputs
        self.request_ids, self.reason = list(self.reasons), next(iter(self.reasons.values()))
        super().__init__(f"{len(self.reasons)} request(s) failed in a step: "
                         + "; ".join(f"request {rid}: {why}" for rid, why in self.reasons.items()))


def _reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class LLMEngine:
    """Requests in, tokens out: `add_request`, then `step` until `has_unfinished` is false (or
    `generate`). Holds the requests' sequences; the scheduler, the executor and the sampler do
    the work of a step."""

    def __init__(self, model: Transformer, config: EngineConfig | None = None) -> None:
        self.model, c = model.eval(), config or EngineConfig()
        dtype = c.cache_dtype or model.tok_emb.weight.dtype
        self.config = c = engine_config.sized(c, model, dtype)
        self.executor = Executor(model, c, dtype)
        self.cache, self.attention_backend = self.executor.cache, self.executor.attention_backend
        # One generator for the requests that bring no seed (vLLM's LLM(seed=...)); None: torch's.
        self.device = self.executor.device  # where sampling draws: its generators too
        self._unseeded = new_generator(c.seed, self.device)
        self.blocks = BlockManager(c.num_blocks, c.block_size, c.enable_prefix_caching)
        self.stats = EngineStats()
        self.scheduler = Scheduler(c, self.blocks, self.cache.copy_block, self.stats)
        self.finished: dict[int, Sequence] = {}
        self.requests: dict[int, list[int]] = {}  # request id -> its samples' seq ids
        self._ids = itertools.count()
        self._seqs: dict[int, Sequence] = {}  # every sample not yet released, by seq id
        self._scheduled: list[Sequence] | None = None  # the running step's sequences
        self.last_plan: SchedulerOutput | None = None  # what the latest step scheduled

    @property
    def waiting(self):
        """The sequences waiting to be scheduled (the scheduler's queue), in order."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        """The sequences of the running batch (the scheduler's), oldest first."""
        return self.scheduler.running

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request can hold: the model's context or the
        KV pool, whichever is smaller."""
        context = self.config.max_model_len or self.model.config.max_seq_len
        return min(context, self.config.num_blocks * self.config.block_size)

    # ---- requests ---------------------------------------------------------------------------

    def check_request(self, prompt: list[int], params: SamplingParams,
                      score_prompt: bool = False) -> None:
        """Raise InvalidRequest if this request could never run here. Reads only the (fixed)
        configuration, so any thread may call it. `score_prompt`: the caller wants only the
        prompt's logprobs and drops the one token the request generates (max_tokens=1; the
        server's echo with max_tokens 0); that token is never read back, so the prompt alone
        must fit: a prompt of the whole context can be scored."""
        c, limit = self.config, self.config.max_model_len or self.model.config.max_seq_len
        if not prompt:
            raise InvalidRequest("prompt is empty: a request needs at least one token", "prompt")
        if score_prompt and params.max_tokens != 1:
            raise ValueError(f"score_prompt needs max_tokens=1, got {params.max_tokens}")
        made = self.max_new_tokens(len(prompt), params)
        total = len(prompt) + (0 if score_prompt else made)
        vocab = self.model.config.vocab_size
        for name, ids in (("prompt", prompt), ("stop_token_ids", params.stops_at())):
            bad = next((i for i, t in enumerate(ids) if not (is_int(t) and 0 <= t < vocab)), None)
            if bad is not None:
                raise InvalidRequest(f"{name}[{bad}]={ids[bad]!r}: token ids must be integers in "
                                     f"[0, {vocab}) (the model's vocabulary)", name)
        if params.min_tokens and len(set(params.stops_at())) >= vocab:
            raise InvalidRequest(f"min_tokens={params.min_tokens}: every token of the vocabulary "
                                 f"({vocab}) is a stop token (stop_token_ids and the EOS), so "
                                 "none could be generated before min_tokens", "min_tokens")
        if total > limit or made < 1:
            asked = "" if score_prompt else f" + max_tokens ({params.max_tokens})"
            raise InvalidRequest(f"prompt ({len(prompt)} tokens){asked} exceeds the model's "
                                 f"context of {limit} tokens", "prompt",
                                 code="context_length_exceeded")
        if params.n > c.max_num_seqs:
            raise InvalidRequest(f"n={params.n}: exceeds max_num_seqs={c.max_num_seqs}", "n")
        alone = -(-len(prompt) // c.block_size)
        if alone > c.num_blocks:
            raise InvalidRequest(f"the prompt's {len(prompt)} tokens need {alone} KV blocks; the "
                                 f"pool has {c.num_blocks} (block_size={c.block_size})", "prompt")
        # The n samples share the prompt's full blocks and each need blocks of their own after.
        shared = len(prompt) // c.block_size
        blocks = shared + params.n * -(-(total - shared * c.block_size) // c.block_size)
        if blocks > c.num_blocks:
            param = "n" if params.n > 1 else "max_tokens"
            raise InvalidRequest(f"{params.n} x {total} tokens need {blocks} KV blocks; the pool "
                                 f"has {c.num_blocks} (block_size={c.block_size})", param)
        if not c.enable_chunked_prefill and len(prompt) > c.max_num_batched_tokens:
            raise InvalidRequest(f"prompt of {len(prompt)} tokens exceeds max_num_batched_tokens="
                                 f"{c.max_num_batched_tokens} and chunked prefill is off", "prompt")

    def _generator(self, seed: int | None) -> torch.Generator | None:
        return self._unseeded if seed is None else new_generator(seed, self.device)

    def max_new_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """The most tokens a request may generate: max_tokens, or (None) what the context and
        the pool leave after the prompt."""
        if params.max_tokens is not None:
            return params.max_tokens
        return self.max_request_tokens - prompt_len

    def add_request(self, prompt: list[int], params: SamplingParams | None = None,
                    score_prompt: bool = False) -> int:
        params = params or SamplingParams()
        self.check_request(prompt, params, score_prompt)
        seq_id = next(self._ids)
        seq = Sequence(seq_id, list(prompt), params, generator=self._generator(params.seed),
                       request_id=seq_id)
        self.requests[seq_id] = [seq_id]
        self._seqs[seq_id] = seq
        self.scheduler.waiting.append(seq)
        return seq_id

    def _fork(self, parent: Sequence, logits: torch.Tensor) -> list[Sequence]:
        """Samples 1..n-1 of a request whose prompt just finished: they share every block of the
        prompt (copy-on-write on the first write into the shared last block) and draw their
        first token from the same logits with their own seeds."""
        p, children = parent.params, []
        for i in range(1, p.n):
            child = Sequence(next(self._ids), parent.prompt, p, num_computed=parent.num_computed,
                             generator=self._generator(None if p.seed is None else p.seed + i),
                             request_id=parent.request_id)
            self.blocks.fork(parent.seq_id, child.seq_id)
            self.requests[parent.request_id].append(child.seq_id)
            self._seqs[child.seq_id] = child
            children.append(child)
        return children

    def abort(self, request_id: int) -> None:
        """Stop every sample of a request and free its blocks (finished ones are left as is)."""
        if request_id not in self.requests:
            raise KeyError(f"unknown request {request_id}")
        for seq_id in self.requests[request_id]:
            self.finish_early(seq_id, "abort")

    def has_request(self, request_id: int) -> bool:
        """The request was added and not yet released."""
        return request_id in self.requests

    def sequence(self, seq_id: int) -> Sequence:
        """A sample by id, live or finished (until its request is released)."""
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id} (never added, or released)") from None

    def samples(self, request_id: int) -> list[Sequence]:
        """A request's samples in index order, live or finished: read them, do not change them
        (`stop_sample`, `abort` and `release` are how callers act on them)."""
        if request_id not in self.requests:
            raise KeyError(f"unknown request {request_id}")
        return [self._seqs[s] for s in self.requests[request_id]]

    def stop_sample(self, seq_id: int) -> None:
        """The caller found a stop string in this sample's text: end it now with finish_reason
        "stop" (and free its blocks), or, if its last token already ended it, say "stop"."""
        seq = self.sequence(seq_id)
        if seq.finish_reason is None:
            self.finish_early(seq_id, "stop")
        elif seq.finish_reason == "length":
            seq.finish_reason = "stop"

    def finish_early(self, seq_id: int, reason: str) -> None:
        """End one live sample now (abort, or a stop string seen by the caller)."""
        seq = self.sequence(seq_id)
        if seq.finish_reason is not None:
            return  # already finished
        self.scheduler.remove(seq)
        if self.blocks.has(seq_id):
            self.blocks.free(seq_id)
        self._finish(seq, reason)

    def fail(self, request_ids: list[int], reason: str = "error") -> None:
        """End every live sample of these requests with finish_reason `reason` and free their
        blocks. Safe on a state a raising step left half-updated: a sample forked but not yet
        scheduled is dropped from its request."""
        live = {s.seq_id: s for s in (*self.running, *self.waiting)}
        for rid in request_ids:
            for seq_id in list(self.requests.get(rid, ())):
                seq = live.get(seq_id)
                if seq is not None:
                    self.finish_early(seq_id, reason)
                elif seq_id not in self.finished:  # forked in the failed step, never scheduled
                    self.requests[rid].remove(seq_id)
                    self._seqs.pop(seq_id, None)
                    if self.blocks.has(seq_id):
                        self.blocks.free(seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def is_finished(self, request_id: int) -> bool:
        """Every sample of the request has finished (an aborted or failed prompt never forks)."""
        seqs = [self.finished.get(s) for s in self.requests[request_id]]
        if any(s is None for s in seqs):
            return False
        return len(seqs) == seqs[0].params.n or seqs[0].finish_reason in ("abort", "error")

    def release(self, request_id: int) -> list[Sequence]:
        """Forget a finished request (a server calls this once it has answered); returns its
        samples. `metrics()` keeps counting it."""
        if not self.is_finished(request_id):
            raise ValueError(f"request {request_id} has not finished")
        seq_ids = self.requests.pop(request_id)
        for s in seq_ids:
            del self._seqs[s]
        return [self.finished.pop(s) for s in seq_ids]

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason, seq.finish_time = reason, time.perf_counter()
        self.finished[seq.seq_id] = seq
        st = self.stats
        if reason in ("abort", "error"):
            if reason == "abort":
                st.aborted += 1
            else:
                st.failed += 1
            return
        st.finished += 1
        st.output_tokens += len(seq.output)
        if seq.ttft is not None:
            st.ttft_sum, st.ttft_count = st.ttft_sum + seq.ttft, st.ttft_count + 1
        if seq.tpot is not None:
            st.tpot_sum, st.tpot_count = st.tpot_sum + seq.tpot, st.tpot_count + 1
        st.first_arrival = min(seq.arrival, st.first_arrival or seq.arrival)
        st.last_finish = max(seq.finish_time, st.last_finish or seq.finish_time)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Schedule, run the step's forwards, sample; return the sequences that finished.

        A failure ends only the requests it concerns. If a forward over several rows raises,
        its rows run again in halves until each failing row has raised alone; a request whose
        own rows' forward, or whose sampling, raises ends with finish_reason "error" and its
        blocks are freed. The step's other requests take their tokens as usual (the ones they
        would have taken alone), then `StepFailed` is raised naming the failed requests. If the
        scheduler itself raises, the requests it scheduled (every live one, if it got no plan
        out) fail that way. The engine stays usable."""
        self._scheduled, failures = None, {}
        try:
            done = self._step(failures)
        except Exception as error:
            seqs = self._scheduled if self._scheduled is not None else [*self.running, *self.waiting]
            failures.update((s.request_id, error) for s in seqs if s.request_id not in failures)
            done = []
        if not failures:
            return done
        self.fail(list(failures))
        raise StepFailed({rid: _reason(e) for rid, e in failures.items()}
                         ) from next(iter(failures.values()))

    @torch.no_grad()
    def _step(self, failures: dict[int, Exception]) -> list[Sequence]:
        """The step, with each request's failure put in `failures` (request id -> its
        exception) rather than raised; `step` ends those requests."""
        plan = self.last_plan = self.scheduler.schedule()
        rows = plan.rows
        self._scheduled = [self._seqs[r.seq_id] for r in rows]
        if not rows:
            if self.waiting and not self.running:
                self._scheduled = [self.waiting[0]]  # the request that can never run fails
                raise RuntimeError("the next request cannot be scheduled: the block pool or the "
                                   "token budget is too small for it")
            return []
        last_logits = self._logits(rows, failures)  # row index -> logits of its last new token
        self.stats.steps += 1
        reserved, used = self.blocks.slot_counts()
        self.stats.reserved_slot_steps += reserved
        self.stats.used_slot_steps += used
        # The greedy rows' tokens in one argmax and one transfer, not one per row.
        plain = [b for b, seq in enumerate(self._scheduled)
                 if b in last_logits and is_plain_greedy(seq.params, len(seq.output))]
        argmax = dict(zip(plain, greedy_tokens([last_logits[b] for b in plain])))
        done = []
        for b, row in enumerate(rows):
            if row.request_id in failures:
                continue  # `step` ends its request (every sample of it) after this loop
            try:
                done += self._advance(row, last_logits[b], argmax.get(b))
            except Exception as error:  # noqa: BLE001 - this request fails, the others go on
                failures[row.request_id] = error
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        return [s for s in done if s.request_id not in failures]

    def _logits(self, rows: list[ScheduledRow], failures: dict[int, Exception]
                ) -> dict[int, torch.Tensor]:
        """Each row's logits of its last new token, by row index; a row whose forward raises
        alone puts its request in `failures` and gets none."""
        last = {}
        scoring = [i for i, r in enumerate(rows) if r.prompt_logprobs]
        for i in scoring:  # alone, with every position's logits
            try:
                logits = self._forward([rows[i]], every=True)[0]  # (num_new_tokens, V)
                self._seqs[rows[i].seq_id].record_prompt_logprobs(rows[i].start, logits)
            except Exception as error:  # noqa: BLE001 - this request fails, the others go on
                failures.setdefault(rows[i].request_id, error)
                continue
            last[i] = logits[-1]
        others = [i for i in range(len(rows)) if i not in set(scoring)]
        for group in forward_groups([rows[i].num_new_tokens for i in others],
                                    pack=self.executor.packs):
            self._forward_isolated([others[g] for g in group], rows, last, failures)
        return last

    def _forward_isolated(self, group: list[int], rows: list[ScheduledRow],
                          last: dict[int, torch.Tensor], failures: dict[int, Exception]) -> None:
        """One forward over rows `group` (indices into `rows`), their logits into `last`. If it
        raises, each half runs again, and so on down to single rows: a row that raises alone
        fails its request. Running a row again is safe: it rewrites the KV slots of exactly the
        new tokens that the failed forward may have written (with anything), and nothing else
        of the step (tokens, counts, the prefix cache) has changed before the forwards end."""
        group = [i for i in group if rows[i].request_id not in failures]
        if not group:
            return
        try:
            logits = self._forward([rows[i] for i in group])  # (len(group), V)
        except Exception as error:  # noqa: BLE001 - find the rows it belongs to
            if len(group) == 1:
                failures.setdefault(rows[group[0]].request_id, error)
                return
            log.warning("a forward over %d rows raised (%s); running them again in halves to "
                        "find the failing rows", len(group), _reason(error))
            half = len(group) // 2
            self._forward_isolated(group[:half], rows, last, failures)
            self._forward_isolated(group[half:], rows, last, failures)
            return
        last.update(zip(group, logits))

    def _advance(self, row: ScheduledRow, logits: torch.Tensor, greedy: int | None
                 ) -> list[Sequence]:
        """Account a row's computed tokens; once its prompt is in, fork its request's other
        samples (the first time) and sample the next token of each. Returns the sequences
        that finished."""
        seq, n = self._seqs[row.seq_id], row.num_new_tokens
        seq.num_computed = row.start + n
        if row.is_prefill:
            self.stats.prefill_tokens += n
        else:
            self.stats.decode_tokens += n
        self.blocks.commit(seq.seq_id, seq.tokens[: seq.num_computed])
        if seq.num_computed < len(seq.tokens):
            return []  # a chunk of a longer prompt: no token yet
        first = not seq.output and len(self.requests[seq.request_id]) < seq.params.n
        group = [seq, *self._fork(seq, logits)] if first else [seq]
        done = []
        for s in group:
            if s is not seq:
                self.running.append(s)
            if self._sample(s, logits, greedy):
                done.append(s)
        return done

    def _forward(self, rows: list[ScheduledRow], every: bool = False) -> torch.Tensor:
        """The executor's forward over `rows` (`Executor.forward`): every forward of a step goes
        through here, the one place a test injects a fault into."""
        return self.executor.forward(rows, every)

    def _sample(self, seq: Sequence, logits: torch.Tensor, greedy: int | None = None) -> bool:
        """Append the next token (`greedy`: already taken, for a plain greedy sequence); finish
        the sequence if it stops. True when it finished."""
        p = seq.params
        stops = p.stops_at()
        if greedy is not None and is_plain_greedy(p, len(seq.output)):
            nxt = greedy
        else:
            nxt = sample_token(logits, seq.prompt, seq.output, p, seq.generator)
        if p.logprobs is not None:
            seq.record_logprobs(logits, nxt)
        seq.output.append(nxt)
        self.stats.sampled_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        stopped = nxt in stops  # (masked while fewer than min_tokens were generated)
        if not stopped and len(seq.output) < self.max_new_tokens(len(seq.prompt), p):
            return False
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        if stopped and nxt in p.stop_token_ids:
            seq.stop_reason = nxt  # a stop token of the caller's (vLLM: None for the EOS)
        self._finish(seq, "stop" if stopped else "length")
        return True

    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None
                 ) -> list[list[int]] | list[list[list[int]]]:
        """Run `prompts` to completion; return each one's generated token ids, in order
        (with n > 1, a list of n outputs per prompt). If requests fail, the others still run to
        the end; then `StepFailed` names the failed ones, its `outputs` holding the results
        (None for a failed one)."""
        ids = [self.add_request(p, params) for p in prompts]
        failed: dict[int, str] = {}
        cause = None
        while self.has_unfinished():
            try:
                self.step()
            except StepFailed as error:  # those requests ended; the others go on
                failed.update(error.reasons)
                cause = cause or error.__cause__
        outputs = [None if i in failed else [self.finished[s].output for s in self.requests[i]]
                   for i in ids]
        if not (params and params.n > 1):
            outputs = [o if o is None else o[0] for o in outputs]
        if failed:
            raise StepFailed(failed, outputs) from cause
        return outputs

    def snapshot(self, now: bool = True) -> EngineMetrics:
        """The engine's metrics at this moment. `now=False` skips the walk over every held block
        that the `*_now` fields need (they are None then): counters only, cheap enough to take
        after every step."""
        pool = None
        if now:
            blocks = self.blocks.stats()
            slot_bytes = self.cache.block_bytes() // self.config.block_size
            pool = PoolNow(blocks.reserved_slots * slot_bytes, blocks.used_slots * slot_bytes,
                           blocks.fragmentation)
        return self.stats.metrics(
            running=len(self.running), waiting=len(self.waiting),
            kv_blocks_used=self.blocks.num_used(), kv_blocks_total=self.config.num_blocks,
            prefix_cache_queries=self.blocks.prefix_query_tokens,
            prefix_cache_hits=self.blocks.prefix_hit_tokens, pool=pool)

    def metrics(self) -> dict[str, float | int | None]:
        """Run statistics as a dict (`snapshot()`'s fields): latency of finished requests,
        throughput, KV use, cache hits."""
        return dataclasses.asdict(self.snapshot())
