"""Native kernels radixserve builds itself (plain C for the CPU; see cpu.py)."""
