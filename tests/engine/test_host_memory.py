"""engine.host_allocator_cache: glibc then serves a large block from its heap and keeps it when freed, where by default
it maps each one afresh (the page faults that doubled a 512-token prefill's time on the CPU)."""
import subprocess
import sys

import pytest

from framework.config import compose

PROBE = """
import ctypes, sys
libc = ctypes.CDLL(None)
class Info(ctypes.Structure):   # glibc's struct mallinfo2
    _fields_ = [(f, ctypes.c_size_t) for f in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
if sys.argv[1] == "keep":
    from framework.engine.host_memory import keep_freed_host_memory
    assert keep_freed_host_memory()
block = libc.malloc(64 << 20)
mapped = libc.mallinfo2().hblkhd
libc.free(block)
print(mapped, libc.mallinfo2().fordblks)
"""


def _probe(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    mapped, free = map(int, out.stdout.split())
    return mapped, free


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_large_block_comes_from_the_heap_and_stays_there_when_freed():
    mapped, free = _probe("default")
    assert mapped >= 64 << 20 and free < 64 << 20          # glibc's default: its own mapping, unmapped when freed
    mapped, free = _probe("keep")
    assert mapped < 64 << 20 and free >= 64 << 20          # kept: from the heap, and still there after free


def test_the_switch_is_on_by_default_and_named():
    assert compose([]).engine.host_allocator_cache is True
    assert compose(["engine.host_allocator_cache=false"]).engine.host_allocator_cache is False
