"""The tests' tiny models: models/synthetic.py (seeded random GGUFs, no download)."""
from socllm.models.synthetic import QUANTIZABLE, blocks, byte_tokens, random_blocks, write, write_tiny  # noqa: F401
