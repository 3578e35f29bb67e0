"""dsr1d: run DeepSeek-R1 on CPU servers and tune the machine live while it runs."""

__version__ = "0.1.0"
