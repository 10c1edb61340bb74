"""KV caches: where past tokens' keys and values live (`cache`: none, contiguous, paged, int8) and the paged pool's
bookkeeping (`block_manager`: free list, reference counts, prefix hashes; no torch). Imports only the root
vocabulary."""
