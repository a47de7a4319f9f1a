"""mobile_client: the phone side of HyCo. Never imports vLLM."""

__version__ = "0.1.0"
