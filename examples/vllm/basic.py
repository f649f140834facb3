"""Offline batched generation, written as for vLLM: a list of prompts, one SamplingParams.

Differs from the vLLM script only in its import line (`from vllm import LLM, SamplingParams`)
and the model name (vLLM's would be the hub id "HuggingFaceTB/SmolLM2-135M-Instruct").
"""

from serve import LLM, SamplingParams

prompts = [
    "The capital of France is",
    "My favourite recipe for a rainy day is",
    "def fibonacci(n):",
]
# Sampled, with a seed: the same text on every run.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=0)


def main():
    llm = LLM(model="SmolLM2-135M-Instruct")
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}")
        print(f"Generated: {output.outputs[0].text!r}")


if __name__ == "__main__":
    main()
