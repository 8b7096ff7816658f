"""hybridpd: disaggregated prefill/decode serving for hybrid LLMs."""

__version__ = "0.1.0"
