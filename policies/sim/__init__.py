"""The SoC simulator: socllm's own planner, programs and policies on a simulated phone or laptop
SoC from published figures (HeteroLLM, Agent.xpu), and the profiler's prediction mode."""
