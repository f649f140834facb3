"""Prompts as token ids, written as for vLLM: the engine's tokenizer encodes them, TokensPrompt
carries them, and the generated token ids are decoded back with the same tokenizer.

Differs from the vLLM script only in its import lines (`from vllm import LLM, SamplingParams`,
`from vllm.inputs import TokensPrompt`) and the model name (vLLM's would be the hub id
"HuggingFaceTB/SmolLM2-135M-Instruct").
"""

from serve import LLM, SamplingParams
from serve.inputs import TokensPrompt


def main():
    llm = LLM(model="SmolLM2-135M-Instruct")
    tokenizer = llm.get_tokenizer()

    texts = ["The capital of France is", "Water boils at a temperature of"]
    prompts = [TokensPrompt(prompt_token_ids=tokenizer.encode(text)) for text in texts]
    # A conversation rendered by the tokenizer's chat template, then passed as token ids.
    messages = [{"role": "user", "content": "Name one colour of the rainbow."}]
    chat_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompts.append(TokensPrompt(prompt_token_ids=tokenizer.encode(chat_text, add_special_tokens=False)))

    sampling_params = SamplingParams(temperature=0, max_tokens=16,
                                     stop_token_ids=[tokenizer.eos_token_id])
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        completion = output.outputs[0]
        print(f"Prompt token ids: {output.prompt_token_ids}")
        print(f"Prompt decoded: {tokenizer.decode(output.prompt_token_ids)!r}")
        print(f"Generated token ids: {list(completion.token_ids)}")
        print(f"Generated decoded: {tokenizer.decode(completion.token_ids, skip_special_tokens=True)!r}")
        print(f"Generated text: {completion.text!r}")


if __name__ == "__main__":
    main()
