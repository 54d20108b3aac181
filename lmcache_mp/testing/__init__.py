"""What the tests, the benchmarks and the soak share to drive a real daemon from outside (as
`numpy.testing` is for numpy): starting daemons (`launcher`), the Valkey/Redis and v1 remote
servers (`servers`), a stand-in vLLM worker process (`kv_worker`), the stand-in caches' geometry
and block hashes (`blocks`), probes of a running process (`probes`), KV caches allocated as
vLLM allocates them on a GPU (`vllm_caches`), and what a killed vLLM engine leaves in /dev/shm
(`shm_leftovers`).

Nothing here is imported by the daemon or the connector. The package face imports nothing, so
that importing one module loads only what that module needs (`blocks` and `probes` load no torch)."""
