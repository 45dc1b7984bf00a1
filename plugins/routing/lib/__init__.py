"""What several routing policies share (not plugins themselves: the registry lists only plugins/routing/*.py):
SGLang's approximate radix tree of each worker's cache, the exact view of the workers' caches learnt from their KV
events, and the base of the policies that route on that view."""
