"""socllm: LLM inference across the CPU, GPU and NPU of one device, serving many agents at once.

    import socllm
    client = socllm.connect()              # the service `socllm serve` started in this Ray cluster
    print(client.generate("The capital of France is", max_tokens=16))

The repository's folders are this package's subpackages: socllm.models, socllm.graph,
socllm.memory, socllm.policies, socllm.actors, socllm.scripts.
"""

__all__ = ["connect", "Client", "ServiceNotRunning", "RequestCancelled", "QueueFull", "LLM",
           "Completion"]


def __getattr__(name):          # lazy: `import socllm.models...` does not start Ray
    if name == "QueueFull":
        from socllm.policies.request import QueueFull
        return QueueFull
    if name in ("LLM", "Completion"):
        from socllm.actors.front import llm
        return getattr(llm, name)
    if name in __all__:
        from socllm.actors.front import client
        return getattr(client, name)
    raise AttributeError(f"module 'socllm' has no attribute {name!r}")
