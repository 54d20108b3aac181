"""The `lmcache-mp` command (`main.py`): serve, status, ping, clear, pools, kv-events and the rest.

Loading it loads no torch: `ping`, `status` and `--help` answer in a fraction of a second.
`python -m lmcache_mp.cli` runs it too (`__main__.py`).
"""
