"""The scoreboard (DESIGN.md, "Benchmark protocol"): protocol inputs and cases, timing by CUDA-graph
replay and eager calls, the measured floor, accuracy beside speed, and the report writer."""
