"""KV caches: where past tokens' keys and values live (`cache`: none, contiguous, paged; int8; sliding windows and
attention sinks), the int4 storage they share (`int4`: KIVI-style blocks and their full-precision tail) and the paged
pool's bookkeeping (`block_manager`: free list, reference counts, prefix hashes; no torch). Imports only the root
vocabulary."""
