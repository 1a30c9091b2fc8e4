"""adapt: adaptive decoding-policy controller for speculative-diffusion LLM inference."""

__version__ = "0.1.0"
