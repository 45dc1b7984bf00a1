"""The one C extension (framework/kv_events/_chain.c: the router's block keys and match). Optional: without a C
compiler the install goes on and the pure-Python path runs (framework/kv_events/hashing.py says which)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("framework.kv_events._chain", ["framework/kv_events/_chain.c"], optional=True)])
