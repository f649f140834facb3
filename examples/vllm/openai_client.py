"""The OpenAI client against the server, written as for vLLM's OpenAI-compatible server:
/v1/models, a completion, a chat completion and a streamed chat completion. Start the server
as a vLLM user starts `vllm serve`:

    python -m serve SmolLM2-135M-Instruct --dtype auto --api-key token-abc123 \\
        --tensor-parallel-size 1 --max-model-len 2048 --port 8000

The client is the vLLM one unchanged, but for the model name in the server's command line
(vLLM's would be the hub id "HuggingFaceTB/SmolLM2-135M-Instruct"); the base URL may also come
from OPENAI_API_BASE (for another port).
"""

import os

from openai import OpenAI

openai_api_key = "token-abc123"
openai_api_base = os.environ.get("OPENAI_API_BASE", "http://localhost:8000/v1")


def main():
    client = OpenAI(api_key=openai_api_key, base_url=openai_api_base)

    models = client.models.list()
    model = models.data[0].id
    print(f"Models: {[m.id for m in models.data]}")

    completion = client.completions.create(model=model, prompt="The capital of France is",
                                           max_tokens=16, temperature=0)
    print(f"Completion: {completion.choices[0].text!r}")

    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me a joke about computers."},
    ]
    chat_completion = client.chat.completions.create(model=model, messages=messages,
                                                     max_tokens=16, temperature=0)
    print(f"Chat: {chat_completion.choices[0].message.content!r}")
    print(f"Usage: {chat_completion.usage.prompt_tokens} prompt tokens, "
          f"{chat_completion.usage.completion_tokens} completion tokens")

    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                            temperature=0, stream=True)
    pieces = []
    for chunk in stream:
        delta = chunk.choices[0].delta.content
        if delta:
            pieces.append(delta)
    print(f"Streamed chunks: {len(pieces)}")
    print(f"Streamed: {''.join(pieces)!r}")


if __name__ == "__main__":
    main()
