"""What the tuner and the scoreboard measure with (DESIGN.md, "Benchmark protocol"): the protocol's
head configurations and length mixes, its inputs, timing by CUDA-graph replay and eager calls,
accuracy against the float64 chunked algorithm, the implementations that can be timed (ours and
the peers'), the plain-PyTorch baseline, the hardware floor and the run's environment. It imports
neither flashqla_tune.tune nor flashqla_tune.bench."""
