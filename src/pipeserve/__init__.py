"""pipeserve: an LLM inference server whose behaviour is declared in YAML."""

__version__ = "0.1.0"
