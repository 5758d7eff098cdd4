"""Robustness tools, not benchmarks: they look for what breaks (answers, streams, the engine,
KV pages, memory) under hostile and heavy use, and exit non-zero when anything does; what they
print is a verdict, not a speed.

- `fuzz/` (`python -m bench.robustness.fuzz`, `make fuzz`): valid and hostile requests over
  every HTTP route, each answer judged by an oracle as it comes.
- `soak.py` (`python -m bench.robustness.soak`, `make soak`): hundreds of concurrent streams
  for minutes, clients hanging up, the worker SIGKILLed; nothing may be lost.

They share the server launcher and the /metrics reader with the benchmarks (bench/common.py).
"""
