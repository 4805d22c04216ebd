"""A cost model of data-parallel training across many GPUs: step time, throughput and scaling
efficiency on 1 to thousands of GPUs from one GPU's speed, the gradient size and the network,
calibrated against published large-scale runs (``model.py``, the pure functions;
``calibration.py``, the published runs as data; ``command.py``, ``speedrun scale``). Not used
by a training run."""
