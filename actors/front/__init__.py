"""The front ends: the command line, the OpenAI HTTP ingress, the Python client and socllm.LLM."""
