"""The one C extension (framework/kv_events/native_keys.c: the router's block keys and match). Optional: without a C
compiler the install goes on and the pure-Python path runs (framework/kv_events/hashing.py says which)."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("framework.kv_events.native_keys", ["framework/kv_events/native_keys.c"], optional=True)])
