"""Examples and tools run from the repository root; not part of the installed package.

A regular package (not a namespace one) so that `python -m examples....` from the
repository root always finds this folder first.
"""
