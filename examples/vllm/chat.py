"""Chat over several conversations in one call, written as for vLLM: the model's chat template,
a template of one's own with variables from `chat_template_kwargs`, and an assistant message
continued (`continue_final_message`); each output's `prompt` is the rendered conversation.

Differs from the vLLM script only in its import line (`from vllm import LLM, SamplingParams`)
and the model name (vLLM's would be the hub id "HuggingFaceTB/SmolLM2-135M-Instruct").
"""

from serve import LLM, SamplingParams

conversations = [
    [
        {"role": "system", "content": "You are a geography teacher. Answer in one sentence."},
        {"role": "user", "content": "What is the capital of Italy?"},
    ],
    [
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
    [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a fact about cats."},
    ],
]

# ChatML, as SmolLM2 was trained on, with a system prompt taken from a template variable.
CHATML_TEMPLATE = (
    "{% if system_prompt %}<|im_start|>system\n{{ system_prompt }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def print_outputs(outputs):
    for output in outputs:
        print(f"Prompt: {output.prompt!r}")
        print(f"Generated: {output.outputs[0].text!r}")


def main():
    llm = LLM(model="SmolLM2-135M-Instruct")
    sampling_params = SamplingParams(temperature=0, max_tokens=16)

    print("== the model's chat template, three conversations ==")
    outputs = llm.chat(conversations, sampling_params, add_generation_prompt=True,
                       continue_final_message=False)
    print_outputs(outputs)

    print("== a template of our own, with chat_template_kwargs ==")
    outputs = llm.chat(conversations[1:], sampling_params, chat_template=CHATML_TEMPLATE,
                       add_generation_prompt=True, continue_final_message=False,
                       chat_template_kwargs={"system_prompt": "You are a poet."})
    print_outputs(outputs)

    print("== the assistant's last message continued ==")
    prefilled = [
        {"role": "user", "content": "List the three primary colours."},
        {"role": "assistant", "content": "The three primary colours are"},
    ]
    outputs = llm.chat(prefilled, sampling_params, add_generation_prompt=False,
                       continue_final_message=True)
    print_outputs(outputs)


if __name__ == "__main__":
    main()
