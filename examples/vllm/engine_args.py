"""Engine arguments as a vLLM script passes them (one GPU, default memory settings, eager mode),
and `n` samples per prompt with their `logprobs` read as vLLM's Logprob objects.

On this engine the parallelism, swap space and statistics arguments change nothing at these
values (each is accepted with a log line), `gpu_memory_utilization` sizes the KV pool only on
a CUDA device, and "auto" dtypes keep the model's own. Differs from the vLLM script only in its
import line (`from vllm import LLM, SamplingParams`) and the model name (vLLM's would be the hub
id "HuggingFaceTB/SmolLM2-135M-Instruct").
"""

from serve import LLM, SamplingParams


def main():
    llm = LLM(
        model="SmolLM2-135M-Instruct",
        tensor_parallel_size=1,
        dtype="auto",
        gpu_memory_utilization=0.9,
        enforce_eager=True,
        swap_space=4,
        disable_log_stats=True,
        kv_cache_dtype="auto",
        max_model_len=2048,
        trust_remote_code=True,
        seed=0,
    )
    sampling_params = SamplingParams(n=2, temperature=0.8, top_p=0.95, max_tokens=8, logprobs=3)
    outputs = llm.generate(["The best thing about living by the sea is"], sampling_params)

    for output in outputs:
        print(f"Prompt: {output.prompt!r}")
        for completion in output.outputs:
            print(f"Sample {completion.index}: {completion.text!r} "
                  f"cumulative_logprob={completion.cumulative_logprob:.4f} "
                  f"finish_reason={completion.finish_reason}")
            for token_id, top in zip(completion.token_ids, completion.logprobs):
                chosen = top[token_id]
                ranked = sorted(top.values(), key=lambda logprob: logprob.rank)
                alternatives = ", ".join(f"{lp.decoded_token!r}:{lp.logprob:.3f}" for lp in ranked)
                print(f"  token {token_id} {chosen.decoded_token!r} logprob={chosen.logprob:.4f} "
                      f"rank={chosen.rank} top: {alternatives}")


if __name__ == "__main__":
    main()
