"""Test-only stub of torchvision (see _stub_package.py)."""

import sys

from _stub_package import install

install(sys.modules[__name__], "0.28.0")
