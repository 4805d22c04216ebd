"""Tools that measure a training step's structure and time: graph breaks, compiled regions,
eager ops and host syncs per step, the inputs CUDA graphs would see, and the time of real
steps on real batches (``step_structure.py``, used by ``speedrun flops``, the benchmark
scripts and the tests); how busy the device is over a few steps (``busy.py``, used by
``benchmarks/throughput.py``). Not used by a training run."""
