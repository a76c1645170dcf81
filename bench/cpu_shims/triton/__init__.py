"""Test-only stub of triton (see _stub_package.py)."""

import sys

from _stub_package import install

install(sys.modules[__name__], "3.5.0")
