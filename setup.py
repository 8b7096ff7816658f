"""Build the optional C token encoder (metadata lives in pyproject.toml).

If it fails to build or import, hybridpd.hashing falls back to numpy.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("hybridpd._cbor_tokens", ["hybridpd/_cbor_tokens.c"], optional=True)])
